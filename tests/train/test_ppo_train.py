"""``train(method=ppo)``: it runs from the config with reward functions and / or a reward model
trained with ``--method rm`` (on the policy's own base: a second, frozen adapter; on another base:
loaded apart), logs TRL's PPO metrics, resumes bit for bit mid-way through a rollout batch, raises
the reward on a tiny task, and checks its settings."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from test_grpo_train import (
    files,  # noqa: F401  (fixture)
    grpo_config,  # noqa: F401  (fixture)
)

from lorafuse.testing import assert_close
from lorafuse.train.config import ConfigError, TrainConfig
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


def test_resume_is_bit_for_bit(grpo_config, tmp_path):  # noqa: F811
    # 4 steps per rollout batch: checkpoint-2 is mid-way through one (its episodes and
    # permutations are in the checkpoint), checkpoint-4 at its end
    args = dict(PPO, grad_accum=2, num_mini_batches=2, num_ppo_epochs=2, max_steps=6,
                save_steps=2, save_total_limit=0, lora_dropout=0.1, whiten_rewards=True)  # fmt: skip
    ref = train(grpo_config(output_dir=str(tmp_path / "ref"), **args))
    from safetensors.torch import load_file

    a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
    for start in ("checkpoint-2", "checkpoint-4"):
        out = tmp_path / f"res-{start}"
        resumed = train(grpo_config(output_dir=str(out), resume=str(tmp_path / "ref" / start),
                                    **args))  # fmt: skip
        assert resumed["steps"] == ref["steps"] == 6
        assert resumed["train_loss"] == ref["train_loss"]  # bit-exact, not approximately
        b = load_file(os.path.join(resumed["adapter"], "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert _log(out)[-1] == {**_log(tmp_path / "ref")[-1], **_timing(_log(out)[-1])}
    assert not any("value_head" in k for k in a)  # the adapter is a plain causal-LM LoRA


def _timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.endswith(("_s", "per_s", "_mb"))}


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"reward": []}, "reward"),
        ({"loss_type": "dapo"}, "loss_type"),
        ({"beta": -0.1}, "beta"),
        ({"epsilon_high": 0.3}, "epsilon_high"),
        ({"num_iterations": 2}, "num_iterations"),
        ({"num_ppo_epochs": 0}, "num_ppo_epochs"),
        ({"grad_accum": 3, "num_mini_batches": 2}, "num_mini_batches"),
        ({"vf_coef": -1.0}, "vf_coef"),
        ({"cliprange_value": 0.0}, "cliprange_value"),
        ({"gamma": 1.5}, "gamma"),
        ({"lam": -0.1}, "lam"),
        ({"kl_estimator": "k2"}, "kl_estimator"),
        ({"missing_eos_penalty": -1.0}, "missing_eos_penalty"),
        ({"num_generations": 0}, "num_generations"),
        ({"scale_rewards": "batch"}, "scale_rewards"),
    ],
)
def test_config_checks(kw, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{"method": "ppo", "reward": ["exact"], **kw})


def test_config_defaults_and_other_methods():
    cfg = TrainConfig(method="ppo", reward_model="rm-out")  # a reward model alone is enough
    assert (cfg.beta, cfg.num_generations, cfg.epsilon) == (0.05, 1, 0.2)
    assert TrainConfig(method="grpo", reward=["exact"]).num_generations == 8
    for method in ("grpo", "sft", "rm"):
        with pytest.raises(ConfigError, match="reward_model"):
            TrainConfig(method=method, reward=["exact"] if method == "grpo" else [],
                        reward_model="rm-out")  # fmt: skip


# ---- the reward model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, pair_file, tmp_path_factory):
    """The output dir of a short ``--method rm`` run on the tiny model."""
    out = tmp_path_factory.mktemp("rm") / "out"
    train(TrainConfig(model=tiny_model_dir, data=[pair_file], output_dir=str(out), method="rm",
                      max_seq_length=64, gradient_checkpointing=False, progress=False,
                      save_steps=0, lr=3e-3, dtype="float32", device="cpu", batch_size=4,
                      max_steps=3, num_threads=1, lora_r=8))  # fmt: skip
    return str(out)


def _policy(model_dir):
    from lorafuse.train.model import add_lora, load_for_training

    cfg = TrainConfig(model=model_dir, dtype="float32", device="cpu", method="ppo",
                      reward=["exact"], max_seq_length=64, max_completion_length=8)  # fmt: skip
    base, tok, _ = load_for_training(cfg, torch.device("cpu"))
    model, _ = add_lora(cfg, base)
    return model, tok


def _classifier_scores(model_dir, adapter, seqs, pad):
    """transformers' sequence classifier with the rm adapter: the oracle of the rm's scores."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    seq = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1, dtype=torch.float32, pad_token_id=pad
    )
    seq = PeftModel.from_pretrained(seq, adapter).eval()
    ids = torch.full((len(seqs), max(map(len, seqs))), pad)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        return seq(input_ids=ids, attention_mask=(ids != pad).long()).logits.squeeze(-1)


def test_the_reward_model_shares_the_base(tiny_model_dir, rm_run, tmp_path):
    from lorafuse.train.reward_model import RewardModel

    policy, tok = _policy(tiny_model_dir)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    probe = torch.tensor([[5, 17, 42, 9, 33]])
    with torch.no_grad():
        before = policy(input_ids=probe).logits
    rm = RewardModel.load(rm_run, policy, tiny_model_dir, tok, torch.float32, "cpu")
    assert rm.model is policy and rm.adapter == "reward"  # no second base
    prompts = [[5, 17, 42], [9], [33, 8, 71, 12]]
    completions = [[60, 61, tok.eos_token_id], [7, 8, 9, 10, 11], [99]]
    scores = rm.scores(prompts, completions, rows=2)
    want = _classifier_scores(tiny_model_dir, os.path.join(rm_run, "final"),
                              [p + c for p, c in zip(prompts, completions)], tok.pad_token_id)  # fmt: skip
    assert_close(scores, want, atol=1e-5, rtol=1e-5, name="rm scores")
    assert scores.abs().max() > 1e-3
    # the policy is as it was: the same trainable weights, active adapter and outputs
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    assert policy.active_adapter == "default"
    with torch.no_grad():  # (not bit for bit: the first calls may time the kernels they pick)
        after = policy(input_ids=probe).logits
    assert_close(after, before, atol=1e-5, rtol=1e-5, name="policy logits")
    # a copy of the base elsewhere is another base: loaded apart, the same scores
    other = tmp_path / "other_base"
    shutil.copytree(tiny_model_dir, other)
    policy2, _ = _policy(str(other))
    apart = RewardModel.load(rm_run, policy2, str(other), tok, torch.float32, "cpu")
    assert apart.model is not policy2 and apart.adapter is None
    assert_close(apart.scores(prompts, completions, rows=3), want, atol=1e-5, rtol=1e-5,
                 name="rm scores (own base)")  # fmt: skip


def test_training_with_the_reward_model(grpo_config, rm_run):  # noqa: F811
    cfg = grpo_config(**PPO, reward=[], reward_model=rm_run, max_steps=2, num_ppo_epochs=2)
    summary = train(cfg)
    log = _log(cfg.output_dir)
    assert log[0]["rewards/reward_model/mean"] == log[0]["objective/scores"] != 0
    final = summary["adapter"]
    assert not os.path.exists(os.path.join(final, "reward"))  # only the policy's adapter
    with open(os.path.join(final, "adapter_config.json")) as f:
        assert json.load(f)["task_type"] == "CAUSAL_LM"


def test_a_bad_reward_model_path_is_one_clear_error(grpo_config, tmp_path):  # noqa: F811
    from lorafuse.train.reward_model import RewardModelLoadError

    with pytest.raises(RewardModelLoadError, match="no adapter_config.json"):
        train(grpo_config(**PPO, reward_model=str(tmp_path), max_steps=1))


def test_the_trainers_rollout_batch_is_the_reference(grpo_config, monkeypatch):  # noqa: F811
    """The trainer's own rollout path (scores, π_old / π_ref / values a micro-batch at a time,
    sliced and padded onto the batch's grid, then the targets) gives each episode what TRL's
    equations give on one forward of the whole batch (the reference of test_ppo.py)."""
    from test_ppo import _layout, reference_rollout

    from lorafuse.train import distributed as dist
    from lorafuse.train.ppo import value_head
    from lorafuse.train.ppo_trainer import PPOTrainer

    cfg = grpo_config(**PPO, batch_size=2, grad_accum=2, max_steps=1, lora_dropout=0.0,
                      temperature=0.7, whiten_rewards=True, gamma=0.9, missing_eos_penalty=0.5)  # fmt: skip
    trainer = PPOTrainer(cfg, dist.setup("none"))
    trainer.setup()
    with torch.no_grad():  # a policy unlike the reference, values of order 1
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
        value_head(trainer.model).weight.normal_(std=0.3)
    eos = trainer.tokenizer.eos_token_id
    fixed = [[40, 41, eos], [7, 8, 9, 10, 11, 12], [5], [60, 61, 62, eos]]  # 6 = the length limit
    monkeypatch.setattr(trainer, "_sample", lambda rows, params, n, gen: (
        [(c, c[-1] != eos) for c in fixed[: len(rows)]], 10, 1.0, 0.0))  # fmt: skip
    trainer._new_batch()
    episodes = trainer.buffer
    prompts = [e.prompt_ids for e in episodes]
    assert [e.completion_ids for e in episodes] == fixed
    scores, _ = trainer._score([trainer.data.train[i] for i in trainer._order[:4]], fixed, 1)
    scores = scores - 0.5 * torch.tensor([float(c[-1] != eos) for c in fixed])
    s = dict(beta=cfg.beta, gamma=0.9, lam=cfg.lam, estimator="k1", whiten_rewards=True)
    ids, mask, P, C = _layout(prompts, fixed, trainer.tokenizer.pad_token_id)
    trainer.model.eval()
    r = reference_rollout(trainer.model, value_head(trainer.model), ids, mask, P, C,
                          torch.tensor([len(c) for c in fixed]), scores, s)  # fmt: skip
    for i, e in enumerate(episodes):
        L, V = len(e.completion_ids), e.values.numel()
        assert V == min(L + 1, C)
        for name, ours, ref in (("old_logps", e.old_logps, r["logprobs"][i, :L]),
                                ("values", e.values, r["values"][i, :V]),
                                ("advantages", e.advantages, r["advantages"][i, :L]),
                                ("returns", e.returns, r["returns"][i, :V])):  # fmt: skip
            assert_close(ours, ref, atol=1e-5, rtol=1e-5, name=f"episode {i} {name}")
    assert sorted(trainer.perms[0]) == [0, 1, 2, 3]
