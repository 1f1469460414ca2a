"""--resume is bit-for-bit: a run SIGKILLed after a checkpoint and resumed ends exactly like an
uninterrupted run (same final loss, same adapter bytes). LoRA dropout is on, so the RNG state
matters too. Both runs use one thread so the CPU kernels sum in the same order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from lorafuse.train import status as run_status
from lorafuse.train.engine import train
from lorafuse.train.loop import DEBUG_SLEEP_ENV

ARGS = dict(batch_size=2, grad_accum=2, max_steps=7, save_steps=2, lora_dropout=0.1, num_threads=1,
            lr_scheduler="cosine", warmup_steps=2, max_seq_length=64)  # fmt: skip


def _flags(cfg) -> list[str]:
    flags = []
    for key in ("model", "output_dir", "max_seq_length", "batch_size", "grad_accum", "max_steps",
                "save_steps", "lora_dropout", "num_threads", "lr", "lr_scheduler", "warmup_steps",
                "dtype", "device"):  # fmt: skip
        flags += ["--" + key.replace("_", "-"), str(getattr(cfg, key))]
    return flags + ["--data", *cfg.data, "--no-gradient-checkpointing", "--no-progress"]


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact(make_config, tmp_path):
    threads = torch.get_num_threads()
    try:
        ref = train(make_config(output_dir=str(tmp_path / "ref"), **ARGS))
    finally:
        torch.set_num_threads(threads)
    cfg = make_config(output_dir=str(tmp_path / "run"), **ARGS)
    env = dict(os.environ, **{DEBUG_SLEEP_ENV: "0.4"})
    cmd = [sys.executable, "-m", "lorafuse", "train", *_flags(cfg)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    marker = os.path.join(cfg.output_dir, "checkpoint-4", "lorafuse_manifest.json")  # its last file
    deadline = time.time() + 120
    while not os.path.exists(marker) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, (
        f"the run ended before it could be killed:\n{err.decode()[-2000:]}"
    )
    assert not os.path.exists(os.path.join(cfg.output_dir, "final"))

    # resume with the checkpoint path only: the stored config supplies everything else
    done = subprocess.run([sys.executable, "-m", "lorafuse", "train", "--resume", cfg.output_dir],
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "checkpoint-4" in done.stderr
    # the killed run's lock record was left behind: stale (its process is gone), taken over
    assert "warning: taking over a stale lock: pid " in done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == ref["steps"] == 7
    assert summary["train_loss"] == ref["train_loss"]  # bit-exact, not approximately
    a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
    b = load_file(os.path.join(summary["adapter"], "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint(make_config, tmp_path):
    cfg = make_config(
        output_dir=str(tmp_path / "int"), **{**ARGS, "save_steps": 100, "max_steps": 50}
    )
    env = dict(os.environ, **{DEBUG_SLEEP_ENV: "0.3"})
    proc = subprocess.Popen([sys.executable, "-m", "lorafuse", "train", *_flags(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    log = os.path.join(cfg.output_dir, "logging.jsonl")
    deadline = time.time() + 120
    while not os.path.exists(log) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "checkpoint saved to" in err
    saved = [d for d in os.listdir(cfg.output_dir) if d.startswith("checkpoint-")]
    assert len(saved) == 1 and os.path.isfile(
        os.path.join(cfg.output_dir, saved[0], "trainer_state.safetensors")
    )
    step = int(saved[0].split("-")[1])
    assert 1 <= step < 50
    status = run_status.read(cfg.output_dir)  # what the UI reads
    assert status["state"] == "interrupted" and status["step"] == step
    assert status["checkpoint"] == os.path.join(cfg.output_dir, saved[0])
    assert status["total_steps"] == 50
