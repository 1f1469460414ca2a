"""``lorafuse train-image`` on tiny random SD1.5 / SDXL models: training lowers the loss, a run
SIGKILLed after a checkpoint and resumed ends bit for bit like an uninterrupted one, the command
runs end to end with samples, and diffusers loads the finished file with the same UNet output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lorafuse.commands import main
from lorafuse.testing import make_image_folder, single_thread

one_thread = pytest.fixture(autouse=True)(single_thread)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from lorafuse.testing import save_tiny_sd

    root = tmp_path_factory.mktemp("sd")
    return {f: save_tiny_sd(root / f, f) for f in ("sd15", "sdxl")}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("img") / "train", {
        "2_sks cat": [("a.png", (64, 64), "sks cat, red, sitting"),
                      ("b.jpg", (64, 96), "sks cat, blue, lying")],
        "1_dog": [("c.png", (96, 64), "dog, green")],
    })  # fmt: skip


def _cfg(models, images, tmp_path, **kw):
    from lorafuse.image.config import ImageTrainConfig

    base = dict(model=models["sd15"], data=images, output_dir=str(tmp_path / "out"), resolution=32,
                progress=False, save_steps=0, lr=1e-3, seed=1, device="cpu")  # fmt: skip
    base.update(kw)
    return ImageTrainConfig(**base)


def test_training_lowers_the_loss(models, images, tmp_path):
    from lorafuse.image.trainer import ImageTrainer

    # network_alpha = dim: scale 1, so a few steps move the output; cached latents/texts: fast
    cfg = _cfg(models, images, tmp_path, max_steps=24, batch_size=4, network_dim=4,
               network_alpha=4, cache_latents=True, cache_text_encoder_outputs=True)  # fmt: skip
    tr = ImageTrainer(cfg)
    tr.setup()
    idx = list(range(len(tr.items)))
    caps = [it.caption for it in tr.items]

    def fixed_loss() -> float:
        # One step's loss depends on its random timesteps more than on training progress; the
        # same 8 draws of (noise, t) before and after training measure the progress itself.
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(123)
            return sum(float(tr.loss(idx, caps)) for _ in range(8)) / 8

    before = fixed_loss()
    for _ in range(cfg.max_steps):
        tr.train_step()
    after = fixed_loss()
    assert after < 0.98 * before, (before, after)  # measured: 1.165 -> 1.111


def _flags(cfg) -> list[str]:
    flags = []
    for key in ("model", "data", "output_dir", "resolution", "max_steps", "save_steps", "lr",
                "seed", "device", "batch_size", "caption_dropout_rate", "keep_tokens",
                "noise_offset", "min_snr_gamma", "num_threads", "lr_scheduler", "warmup_steps",
                "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "save_precision"):  # fmt: skip
        flags += ["--" + key.replace("_", "-"), str(getattr(cfg, key))]
    return flags + ["--shuffle-caption", "--enable-bucket", "--no-progress"]


def _losses(output_dir: str, after: int) -> list[float]:
    with open(os.path.join(output_dir, "logging.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["step"] > after]


def _cli(*argv: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lorafuse", "train-image", *argv],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact(models, images, tmp_path):
    """All three runs are fresh processes, as a user's would be (one thread each, so the CPU
    kernels sum in the same order)."""
    from safetensors.torch import load_file

    from lorafuse.train.loop import DEBUG_SLEEP_ENV

    # uncached latents (the VAE draws from the RNG each step), shuffled/dropped captions, noise
    # offset and min-SNR: every random stream a resume has to restore
    args = dict(max_steps=6, save_steps=2, batch_size=2, caption_dropout_rate=0.3, keep_tokens=1,
                shuffle_caption=True, noise_offset=0.1, min_snr_gamma=5.0, num_threads=1,
                enable_bucket=True, min_bucket_reso=32, max_bucket_reso=64, bucket_reso_steps=32,
                lr_scheduler="cosine", warmup_steps=2, save_precision="float")  # fmt: skip
    ref_cfg = _cfg(models, images, tmp_path / "ref", **args)
    done = _cli(*_flags(ref_cfg))
    assert done.returncode == 0, done.stderr[-3000:]
    ref = json.loads(done.stdout.strip().splitlines()[-1])

    cfg = _cfg(models, images, tmp_path / "run", **args)
    env = dict(os.environ, **{DEBUG_SLEEP_ENV: "0.5"})
    proc = subprocess.Popen([sys.executable, "-m", "lorafuse", "train-image", *_flags(cfg)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    marker = os.path.join(cfg.output_dir, "checkpoint-4", "lorafuse_manifest.json")  # its last file
    deadline = time.time() + 180
    while not os.path.exists(marker) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"ended before the kill:\n{err.decode()[-2000:]}"
    assert not os.path.exists(os.path.join(cfg.output_dir, "final"))

    done = _cli("--resume", cfg.output_dir)  # the stored config supplies everything else
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "checkpoint-4" in done.stderr
    # the killed run's lock record was left behind: stale (its process is gone), taken over
    assert "warning: taking over a stale lock: pid " in done.stderr
    ref_dir = os.path.dirname(os.path.dirname(ref["lora"]))
    assert _losses(cfg.output_dir, after=4) == _losses(ref_dir, after=4)  # resumed steps 5, 6
    a = load_file(ref["lora"])
    b = load_file(os.path.join(cfg.output_dir, "final", "lora.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0 and a[next(iter(a))].dtype == torch.float32
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_command_end_to_end_with_samples(models, images, tmp_path, family, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "sks cat, red --n blurry --s 2 --d 7\n# a comment\n\ndog --w 72 --h 64 --s 2\n"
    )
    out = tmp_path / "out"
    argv = ["train-image", "--model", models[family], "--data", images, "--output-dir", str(out),
            "--resolution", "32", "--max-steps", "2", "--sample-every-n-steps", "2",
            "--sample-prompts", str(prompts), "--no-progress", "--network-dim", "2",
            "--conv-dim", "2", "--output-name", "tiny"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["lora"] == str(out / "final" / "lora.safetensors")
    from lorafuse import heap  # applied for the run, reverted by train_image when it ended

    assert "glibc keeps freed buffers" in captured.err
    assert heap.threshold() == 0 and heap.large_buffers_from() == 0
    assert sorted(os.listdir(out / "samples")) == [
        "step-000002-00.png", "step-000002-01.png", "step-000002-grid.png"
    ]  # fmt: skip
    from PIL import Image

    assert Image.open(out / "samples" / "step-000002-01.png").size == (72, 64)
    assert Image.open(out / "samples" / "step-000002-grid.png").size == (2 * 72, 64)
    from lorafuse.image.kohya import load_lora_file

    state, meta = load_lora_file(summary["lora"])
    assert meta["ss_output_name"] == "tiny" and meta["ss_network_dim"] == "2"
    assert json.loads(meta["ss_tag_frequency"])["2_sks cat"]["sks cat"] == 2
    assert all(v.dtype == torch.float16 for v in state.values())
    assert any(k.startswith("lora_te") for k in state) is False
    stored = json.loads((out / "final" / "lorafuse_config.json").read_text())
    assert stored["resolution"] == 32 and stored["conv_dim"] == 2
    assert len((out / "logging.jsonl").read_text().splitlines()) == 2


def test_final_file_loads_in_diffusers_with_the_same_output(models, images, tmp_path):
    """The trained file through diffusers' load_lora_weights gives our network's UNet output."""
    from diffusers import StableDiffusionPipeline

    from lorafuse.image.kohya import from_kohya_state_dict, load_lora_file
    from lorafuse.image.models import load_sd_model
    from lorafuse.image.network import LoRANetwork
    from lorafuse.image.trainer import train_image

    summary = train_image(_cfg(models, images, tmp_path, max_steps=3, network_dim=2, conv_dim=2,
                               train_text_encoder=True, lr=1e-2, save_precision="float"))  # fmt: skip
    state, _ = load_lora_file(summary["lora"])
    sd = load_sd_model(models["sd15"])
    net = LoRANetwork.create(sd.unet, sd.text_encoders, dim=2, alpha=1.0, conv_dim=2,
                             train_text_encoder=True)  # fmt: skip
    net.load_lora_tensors(from_kohya_state_dict(state, "sd1"))
    net.apply_to()
    torch.manual_seed(0)
    x, t, ctx = torch.randn(1, 4, 16, 16), torch.tensor([500]), torch.randn(1, 77, 32)
    with torch.no_grad():
        ours = sd.unet(x, t, ctx).sample
        pipe = StableDiffusionPipeline.from_pretrained(models["sd15"], safety_checker=None)
        base = pipe.unet(x, t, ctx).sample
        pipe.load_lora_weights(summary["lora"])
        theirs = pipe.unet(x, t, ctx).sample
    assert (ours - base).abs().max() > 1e-4  # the LoRA changed the output...
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)  # ...the same way in diffusers


def test_network_weights_continue_from_a_kohya_file(models, images, tmp_path):
    from lorafuse.image.kohya import from_kohya_state_dict, load_lora_file
    from lorafuse.image.trainer import ImageTrainer, train_image

    first = train_image(_cfg(models, images, tmp_path / "a", max_steps=2, conv_dim=2,
                             save_precision="float"))  # fmt: skip
    tr = ImageTrainer(_cfg(models, images, tmp_path / "b", max_steps=1, conv_dim=2,
                           network_weights=first["lora"]))  # fmt: skip
    tr.setup()
    want = from_kohya_state_dict(load_lora_file(first["lora"])[0], "sd1")
    got = tr.network.lora_tensors()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k]["down"], got[k]["down"]) and torch.equal(
            want[k]["up"], got[k]["up"]
        )
    assert any(float(t["up"].abs().max()) > 0 for t in got.values())  # trained, not the zero init


def test_sdxl_bf16_checkpointed_with_text_encoders(models, images, tmp_path):
    """The remaining branches in one short run: autocast bf16 (frozen weights bf16, LoRA fp32),
    gradient checkpointing, both text encoders trained with their own lr, v-prediction."""
    import math

    from lorafuse.image.kohya import load_lora_file
    from lorafuse.image.trainer import ImageTrainer

    cfg = _cfg(models, images, tmp_path, model=models["sdxl"], max_steps=2, mixed_precision="bf16",
               gradient_checkpointing=True, train_text_encoder=True, text_encoder_lr=5e-4,
               v_parameterization=True, min_snr_gamma=5.0, noise_offset=0.05)  # fmt: skip
    tr = ImageTrainer(cfg)
    tr.setup()
    assert next(tr.sd.unet.parameters()).dtype == torch.bfloat16
    assert {p.dtype for p in tr.params} == {torch.float32}
    assert [g["lr"] for g in tr.optimizer.param_groups] == [5e-4, 1e-3]  # text encoders, UNet
    summary = tr.run()
    assert math.isfinite(summary["train_loss"])
    state, meta = load_lora_file(summary["lora"])
    assert any(k.startswith("lora_te1_") for k in state) and any(
        k.startswith("lora_te2_") for k in state
    )
    assert (
        meta["ss_base_model_version"] == "sdxl_base_v1-0"
        and meta["ss_v_parameterization"] == "True"
    )
    te_up = [v for k, v in state.items() if k.startswith("lora_te") and "lora_up" in k]
    assert any(float(v.abs().max()) > 0 for v in te_up)  # the text-encoder LoRA was trained
    unet_up = [v for k, v in state.items() if k.startswith("lora_unet") and "lora_up" in k]
    assert all(float(v.abs().max()) > 0 for v in unet_up)  # and every UNet one, through checkpoints


def test_status_json_finished_and_interrupted(models, images, tmp_path, monkeypatch):
    """An image run records how it ended in status.json, as ``lorafuse train`` does: finished
    with its summary; SIGTERM mid-run -> a checkpoint of that step and ``interrupted``."""
    from lorafuse.image.trainer import ImageTrainer, train_image
    from lorafuse.train import status as run_status
    from lorafuse.train.loop import TrainingInterrupted

    summary = train_image(_cfg(models, images, tmp_path / "a", max_steps=1, network_dim=2))
    st = run_status.read(tmp_path / "a" / "out")
    assert st["state"] == "finished" and st["step"] == st["total_steps"] == 1
    assert st["summary"]["lora"] == summary["lora"] and os.path.isfile(summary["lora"])

    real_step = ImageTrainer.train_step

    def step(self):  # the UI's Stop (SIGTERM) arrives during step 2
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    monkeypatch.setattr(ImageTrainer, "train_step", step)
    out = tmp_path / "b" / "out"
    with pytest.raises(TrainingInterrupted, match="interrupted at step 2"):
        train_image(_cfg(models, images, tmp_path / "b", max_steps=4, network_dim=2))
    st = run_status.read(out)
    assert st["state"] == "interrupted" and st["step"] == 2
    assert st["checkpoint"] == str(out / "checkpoint-2") and not (out / "final").exists()


def test_run_dir_claimed_and_torn_checkpoints_skipped(models, images, tmp_path, capsys):
    """train-image holds its output dir as ``lorafuse train`` does: a second run is refused,
    --resume skips a checkpoint whose LoRA file was truncated, --overwrite moves the run aside;
    its checkpoints hold the trainer state without pickle, under a manifest."""
    from lorafuse.image.trainer import train_image
    from lorafuse.train.run_dir import RunDirError

    out = tmp_path / "out"
    train_image(_cfg(models, images, tmp_path, max_steps=2, save_steps=1, save_total_limit=0))
    assert {"trainer_state.safetensors", "trainer_state.json", "lorafuse_manifest.json"} <= set(
        os.listdir(out / "checkpoint-2")
    ) and not list(out.rglob("*.pt"))
    with pytest.raises(RunDirError, match="already holds a finished run .* --overwrite"):
        train_image(_cfg(models, images, tmp_path, max_steps=2))
    lora = out / "checkpoint-2" / "lora.safetensors"
    os.truncate(lora, os.path.getsize(lora) - 1)
    capsys.readouterr()
    summary = train_image(_cfg(models, images, tmp_path, max_steps=3, resume=str(out)))
    err = capsys.readouterr().err
    assert f"skipping {out}/checkpoint-2: lora.safetensors is " in err
    assert f"resuming from {out}/checkpoint-1 (step 1)" in err and summary["steps"] == 3
    train_image(_cfg(models, images, tmp_path, max_steps=1, overwrite=True))
    aside = list(tmp_path.glob("out.old-*"))
    assert len(aside) == 1 and (aside[0] / "checkpoint-3").is_dir()
    assert sorted(os.listdir(out)) == ["checkpoint-1", "final", "logging.jsonl", "status.json"]
