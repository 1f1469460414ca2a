"""``train(method=grpo)``: it runs from the config and logs TRL's metrics, resumes bit for bit
(generator and a reused generation batch included), stops on a reward that raises, returns the
wrong length or NaN with a message naming the reward and the prompt; the config checks."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.engine import train
from lorafuse.train.rewards import RewardError

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

REWARDS_PY = """
def _text(c):  # chat prompts get their completion as [{"role": "assistant", "content": ...}]
    return c if isinstance(c, str) else c[0]["content"]

def digits(prompts, completions, **kw):
    return [sum(ch.isdigit() for ch in _text(c)) / 4 for c in completions]

def raises(prompts, completions, **kw):
    raise ValueError("boom")

def short(prompts, completions, **kw):
    return [0.0] * (len(completions) - 1)

def nan(prompts, completions, **kw):
    return [float("nan")] * len(completions)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(8):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            q = f"what is {a} and {b}"
            rec = {"prompt": q} if i % 2 else {"messages": [{"role": "user", "content": q}]}
            f.write(json.dumps({**rec, "answer": str(a + b)}) + "\n")
    (root / "rewards.py").write_text(REWARDS_PY)
    return str(root / "prompts.jsonl"), str(root / "rewards.py")


@pytest.fixture
def grpo_config(tiny_model_dir, files, tmp_path):
    data, rewards = files

    def make(**kw):
        base = dict(model=tiny_model_dir, data=[data], output_dir=str(tmp_path / "out"),
                    max_seq_length=48, max_completion_length=6, num_generations=3,
                    gradient_checkpointing=False, progress=False, save_steps=0, lr=2e-3,
                    dtype="float32", device="cpu", method="grpo", lr_scheduler="constant",
                    num_threads=1, batch_size=2,
                    reward=[f"{rewards}:digits", "regex:[0-9]=0.5", "exact"])  # fmt: skip
        base.update(kw)
        return TrainConfig(**base)

    return make


def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def test_training_logs_the_grpo_metrics(grpo_config, files):
    cfg = grpo_config(max_steps=2, beta=0.04, eval_split=0.25)
    summary = train(cfg)
    log = _log(cfg.output_dir)
    rewards = files[1]
    want = {"loss", "reward", "reward_std", f"rewards/{rewards}:digits/mean",
            "rewards/regex:[0-9]/std", "rewards/exact/mean", "frac_reward_zero_std",
            "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean",
            "kl", "entropy", "gen_tokens_per_s", "tokens_per_s"}  # fmt: skip
    assert want <= log[0].keys(), want - log[0].keys()
    assert 0 < log[0]["completions/mean_length"] <= 6 and log[0]["gen_tokens_per_s"] > 0
    assert summary["steps"] == 2 and summary["eval_reward"] is not None
    stored = json.load(open(os.path.join(summary["adapter"], "lorafuse_config.json")))
    assert stored["method"] == "grpo" and stored["beta"] == 0.04 and stored["loss_type"] == "dapo"


def test_resume_is_bit_for_bit(grpo_config, tmp_path):
    # num_iterations 2 with a checkpoint after step 1: the resume continues a reused batch
    args = dict(grad_accum=2, max_steps=4, save_steps=1, save_total_limit=0, lora_dropout=0.1,
                beta=0.04, num_iterations=2, loss_type="grpo", epsilon_high=0.28)  # fmt: skip
    ref = train(grpo_config(output_dir=str(tmp_path / "ref"), **args))
    for start in ("checkpoint-1", "checkpoint-2"):
        out = tmp_path / f"res-{start}"
        resumed = train(grpo_config(output_dir=str(out),
                                    resume=str(tmp_path / "ref" / start), **args))  # fmt: skip
        assert resumed["steps"] == ref["steps"] == 4
        assert resumed["train_loss"] == ref["train_loss"]  # bit-exact, not approximately
        from safetensors.torch import load_file

        a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
        b = load_file(os.path.join(resumed["adapter"], "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert _log(out)[-1]["reward"] == _log(tmp_path / "ref")[-1]["reward"]


@pytest.mark.parametrize(
    "fn, match",
    [
        ("raises", r"reward .*:raises raised ValueError: boom \(prompts from '"),
        ("short", r"returned 5 values for 6 completions \(prompts from '"),
        ("nan", r"returned nan for the completion of prompt '"),
    ],
)
def test_reward_errors_stop_the_run(grpo_config, files, fn, match):
    cfg = grpo_config(max_steps=1, reward=[f"{files[1]}:{fn}"])
    with pytest.raises(RewardError, match=match):
        train(cfg)


def test_an_unknown_reward_fails_before_training(grpo_config):
    with pytest.raises(RewardError, match="cannot load nosuchmodule:fn"):
        train(grpo_config(reward=["nosuchmodule:fn"]))


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"reward": []}, "reward"),
        ({"num_generations": 1}, "num_generations"),
        ({"loss_type": "sigmoid"}, "loss_type"),
        ({"beta": -0.1}, "beta"),
        ({"temperature": 0.0}, "temperature"),
        ({"scale_rewards": "sometimes"}, "scale_rewards"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"max_completion_length": 2048}, "max_completion_length"),
        ({"epsilon_high": 0.0}, "epsilon_high"),
        ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_neg"),
        ({"cpo_alpha": 1.0}, "cpo_alpha"),
    ],
)
def test_config_checks(kw, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{"method": "grpo", "reward": ["exact"], **kw})


def test_a_config_file_may_name_one_reward(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method: grpo\nreward: exact:label\nnum_generations: 4\n")
    cfg = TrainConfig.from_file(str(path))
    assert cfg.reward == ["exact:label"] and cfg.num_generations == 4


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_cispo_and_sapo_train(grpo_config, loss_type):
    cfg = grpo_config(max_steps=2, beta=0.04, loss_type=loss_type, num_iterations=2)
    summary = train(cfg)
    log = _log(cfg.output_dir)
    assert summary["steps"] == 2 and all(math.isfinite(r["loss"]) for r in log)
    assert ("cispo_clip_ratio" in log[0]) == (loss_type == "cispo")
    assert "clip_ratio/region_mean" not in log[0] and "kl" in log[0]


def test_method_defaults():
    assert TrainConfig(method="grpo", reward=["exact"], loss_type="cispo").epsilon_high == 5.0
    assert TrainConfig(method="grpo", reward=["exact"]).epsilon_high is None
    assert TrainConfig(method="grpo", reward=["exact"]).beta == 0.0
    assert TrainConfig(method="grpo", reward=["exact"]).loss_type == "dapo"
    assert (
        TrainConfig(method="dpo").beta == 0.1 and TrainConfig(method="dpo").loss_type == "sigmoid"
    )
    with pytest.raises(ConfigError, match="reward"):
        TrainConfig(method="sft", reward=["exact"])


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_that_resumes(tiny_model_dir, files, tmp_path):
    """SIGTERM (the UI's Stop) mid-run: a checkpoint after the current step, which ``--resume``
    (with only the checkpoint path) finishes."""
    import signal
    import subprocess
    import sys
    import time

    from lorafuse.train.loop import DEBUG_SLEEP_ENV

    out = tmp_path / "run"
    flags = ["train", "--model", tiny_model_dir, "--data", files[0], "--output-dir", str(out),
             "--method", "grpo", "--reward", "exact", f"{files[1]}:digits", "--num-generations",
             "2", "--max-completion-length", "4", "--max-seq-length", "48", "--max-steps", "30",
             "--num-iterations", "2", "--save-steps", "100", "--no-progress", "--dtype",
             "float32", "--device", "cpu", "--no-gradient-checkpointing"]  # fmt: skip
    env = dict(os.environ, **{DEBUG_SLEEP_ENV: "0.3"})
    proc = subprocess.Popen([sys.executable, "-m", "lorafuse", *flags], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    log = out / "logging.jsonl"
    deadline = time.time() + 180
    while not log.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert "checkpoint saved to" in err, err[-2000:]
    saved = [d for d in os.listdir(out) if d.startswith("checkpoint-")]
    assert len(saved) == 1 and 1 <= int(saved[0].split("-")[1]) < 30
    done = subprocess.run([sys.executable, "-m", "lorafuse", "train", "--resume", str(out),
                           "--max-steps", str(int(saved[0].split("-")[1]) + 2)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr
