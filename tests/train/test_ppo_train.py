"""``train(method=ppo)``: it runs from the config with reward functions and / or a reward model
trained with ``--method rm`` (on the policy's own base: a second, frozen adapter; on another base:
loaded apart), logs TRL's PPO metrics, resumes bit for bit mid-way through a rollout batch, raises
the reward on a tiny task, and checks its settings."""

from __future__ import annotations

import json
import math
import os

import pytest
from test_grpo_train import (
    files,  # noqa: F401  (fixture)
    grpo_config,  # noqa: F401  (fixture)
)

from lorafuse.train.engine import train

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
PPO = dict(method="ppo", num_generations=None, beta=None)


def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def test_training_logs_the_ppo_metrics(grpo_config):  # noqa: F811
    cfg = grpo_config(**PPO, grad_accum=2, num_mini_batches=2, num_ppo_epochs=2, max_steps=4,
                      eval_split=0.25, missing_eos_penalty=1.0)  # fmt: skip
    summary = train(cfg)
    log = _log(cfg.output_dir)
    want = {"loss", "reward", "objective/scores", "objective/kl", "objective/rlhf_reward",
            "loss/policy", "loss/value", "policy/clipfrac", "val/clipfrac", "policy/approxkl",
            "val/ratio", "val/num_eos_tokens", "completions/mean_length"}  # fmt: skip
    assert want <= log[0].keys(), want - log[0].keys()
    assert all(math.isfinite(r["loss"]) for r in log)
    assert log[0]["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # first minibatch: π = π_old
    assert summary["steps"] == 4 and summary["eval_reward"] is not None


EVEN_PY = """
def even(prompts, completions, completion_ids, **kw):
    return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]
"""


def test_the_reward_rises(grpo_config, tmp_path):  # noqa: F811
    """A tiny task: the share of even token ids in 6-token completions, from a random policy."""
    (tmp_path / "even.py").write_text(EVEN_PY)
    cfg = grpo_config(**{**PPO, "beta": 0.01, "num_generations": 4},
                      reward=[f"{tmp_path / 'even.py'}:even"], batch_size=4, grad_accum=2, num_mini_batches=2,
                      num_ppo_epochs=4, max_steps=160, lr=2e-2)  # fmt: skip
    train(cfg)
    rewards = [r["reward"] for r in _log(cfg.output_dir)][::8]  # one per rollout batch
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.25, rewards
