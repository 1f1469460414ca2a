"""RLOO: on the same prompts, completions and rewards, our advantages (leave-one-out, KL reward
penalty, optional normalisation), loss and every LoRA gradient equal TRL's ``RLOOTrainer`` (its own
``_generate_and_score_completions`` and ``_compute_loss``, generation replaced by the fixed
completions); ``lorafuse train --method rloo`` runs and resumes bit for bit; config checks."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
from test_grpo import MAX_LEN, REWARDS, TARGETS, TEMPERATURE, G, _completions, _lora_grads, _perturb
from test_grpo_train import (
    files,  # noqa: F401  (fixture)
    grpo_config,  # noqa: F401  (fixture)
)

from lorafuse.testing import assert_close
from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.engine import train
from lorafuse.train.grpo import Sample
from lorafuse.train.rewards import combine, score
from lorafuse.train.rloo import RLOOObjective, kl_penalty, rloo_advantages

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset
    from peft import (
        LoraConfig,
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    from lorafuse import patch_peft_model
    from lorafuse.testing import save_tiny_model

    model_dir = tmp_path_factory.mktemp("tiny_rloo")
    save_tiny_model(model_dir, scale=1.0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # noqa: E731
    prompts = ["what is 3 and 4", "hello", "name a colour please", "x"]
    answers = ["7", "skip", "11", "5"]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    completions = _completions(tok, len(prompts))
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    stock = get_peft_model(load(), lora)
    ours = patch_peft_model(copy.deepcopy(stock))
    args = RLOOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], use_cpu=True,
                      bf16=False, gradient_checkpointing=False, num_generations=G,
                      per_device_train_batch_size=len(prompts) * G, max_completion_length=MAX_LEN,
                      temperature=TEMPERATURE, reward_weights=[r.weight for r in REWARDS])  # fmt: skip
    ds = Dataset.from_list([{"prompt": p, "answer": a} for p, a in zip(prompts, answers)])
    trainer = RLOOTrainer(model=load(), reward_funcs=[r.fn for r in REWARDS], args=args,
                          train_dataset=ds, processing_class=tok,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))  # fmt: skip
    result = set_peft_model_state_dict(trainer.model, get_peft_model_state_dict(stock))
    assert not result.unexpected_keys
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    data = dict(prompts=prompts, answers=answers, prompt_ids=prompt_ids, completions=completions)
    return tok, data, trainer, stock, ours


def _trl_inputs(trainer, tok, data):
    P = [ids for ids in data["prompt_ids"] for _ in range(G)]
    texts = tok.batch_decode(data["completions"], skip_special_tokens=True)
    trainer._generate = lambda prompts: (P, data["completions"], texts)
    inputs = [{"prompt": p, "answer": a} for p, a in zip(data["prompts"], data["answers"])
              for _ in range(G)]  # fmt: skip
    return trainer._generate_and_score_completions(inputs)


def _our_samples(obj, model, tok, data, beta, normalize):
    """Our trainer's order (rloo_trainer.RLOOTrainer): rewards, π_old and π_ref, then the
    penalised rewards' leave-one-out advantages."""
    prompts = [p for p in data["prompts"] for _ in range(G)]
    texts = tok.batch_decode(data["completions"], skip_special_tokens=True)
    columns = {"answer": [a for a in data["answers"] for _ in range(G)],
               "completion_ids": data["completions"]}  # fmt: skip
    _, per = score(REWARDS, prompts, texts, columns)
    total = combine(REWARDS, per)
    samples = [
        Sample(data["prompt_ids"][i // G], c, 0.0) for i, c in enumerate(data["completions"])
    ]
    for s, lp in zip(samples, obj.logps(model, samples)):
        s.old_logps = lp
    if beta:
        for s, lp in zip(samples, obj.logps(model, samples, reference=True)):
            s.ref_logps = lp
        total = total - beta * kl_penalty(samples)
    adv, _ = rloo_advantages(total, G, normalize)
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    return samples, adv


CASES = [(0.0, 0.2, 0.2, False, False), (0.05, 0.2, 0.28, True, False),
         (0.05, 0.1, 0.3, True, True), (0.0, 0.2, 0.2, False, True)]  # fmt: skip


@pytest.mark.parametrize("beta, eps, eps_high, perturb, normalize", CASES)
def test_rloo_loss_and_grads_equal_trl(setup, beta, eps, eps_high, perturb, normalize):
    tok, data, trl, stock, ours = setup
    saved = {(id(m), n): p.detach().clone() for m in (trl.model, stock, ours)
             for n, p in m.named_parameters() if p.requires_grad}  # fmt: skip
    trl.beta, trl.epsilon_low, trl.epsilon_high = beta, eps, eps_high
    trl.normalize_advantages = normalize
    trl._metrics["train"].clear()
    try:
        inputs = _trl_inputs(trl, tok, data)
        obj = RLOOObjective(None, beta, eps, eps_high, MAX_LEN, TEMPERATURE, tok.pad_token_id)
        per_model = {}
        for name, model in (("stock", stock), ("lorafuse", ours)):
            samples, adv = _our_samples(obj, model, tok, data, beta, normalize)
            assert_close(adv, inputs["advantages"], atol=2e-5, rtol=1e-5, name="advantages")
            # then TRL's own values: a zero-std group's normalised advantages are ±1e-8 noise whose
            # sign decides TRL's clip counts; the loss is checked on identical advantages
            for s, a in zip(samples, inputs["advantages"].tolist()):
                s.advantage = a
            per_model[name] = samples
        assert inputs["advantages"].abs().max() > 0.1
        if perturb:  # a later step over the same generation batch: ratios move, some clip
            _perturb([trl.model, stock, ours], seed=int(100 * eps))
        ref_loss = trl._compute_loss(trl.model, inputs)
        ref_loss.backward()
        ref_grads = _lora_grads(trl.model)
        for name, model in (("stock", stock), ("lorafuse", ours)):
            samples = per_model[name]
            counts = obj.counts(samples)
            loss, sums = obj.loss(model, samples, counts)
            loss.backward()
            grads = _lora_grads(model)
            assert_close(
                loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5, name=f"{name} loss"
            )
            assert grads.keys() == ref_grads.keys() and grads
            for k in grads:
                scale = ref_grads[k].abs().max().item()
                assert_close(grads[k], ref_grads[k], atol=1e-5 * scale, rtol=1e-5, name=k)
            metrics = obj.metrics(sums, counts)
            for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
                assert metrics[key] == pytest.approx(trl._metrics["train"][key][-1], abs=1e-6)
        if perturb:
            assert trl._metrics["train"]["clip_ratio/region_mean"][-1] > 0
    finally:
        with torch.no_grad():
            for m in (trl.model, stock, ours):
                for n, p in m.named_parameters():
                    if p.requires_grad:
                        p.copy_(saved[(id(m), n)])


def test_leave_one_out_by_hand():
    r = torch.tensor([1.0, 2.0, 4.0, float("nan"), 0.0, 0.0, 3.0, 5.0])
    adv, zero = rloo_advantages(r, 4)
    # group 1: 1 - (2+4)/2, 2 - (1+4)/2, 4 - (1+2)/2, unscorable -> 0; group 2 likewise
    assert adv.tolist() == pytest.approx([-2.0, -0.5, 2.5, 0.0, -8 / 3, -8 / 3, 4 / 3, 4.0])
    assert not zero.any()


# ---- the engine ------------------------------------------------------------------------------
def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def test_training_logs_and_resumes(grpo_config, tmp_path):  # noqa: F811
    args = dict(method="rloo", grad_accum=2, max_steps=4, save_steps=2, num_iterations=2,
                normalize_advantages=True)  # fmt: skip
    ref = train(grpo_config(output_dir=str(tmp_path / "ref"), **args))
    log = _log(tmp_path / "ref")
    assert {"loss", "reward", "kl", "clip_ratio/region_mean", "frac_reward_zero_std"} <= log[
        0
    ].keys()
    assert all(math.isfinite(r["loss"]) for r in log)
    resumed = train(grpo_config(output_dir=str(tmp_path / "res"),
                                resume=str(tmp_path / "ref" / "checkpoint-2"), **args))  # fmt: skip
    assert resumed["train_loss"] == ref["train_loss"]  # bit-exact
    from safetensors.torch import load_file

    a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
    b = load_file(os.path.join(resumed["adapter"], "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"loss_type": "dapo"}, "loss_type"),
        ({"reward": []}, "reward"),
        ({"scale_rewards": "batch"}, "scale_rewards"),
        ({"beta": -1.0}, "beta"),
    ],
)
def test_config_checks(kw, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{"method": "rloo", "reward": ["exact"], **kw})
    assert TrainConfig(method="rloo", reward=["exact"]).beta == 0.05
    with pytest.raises(ConfigError, match="normalize_advantages"):
        TrainConfig(method="grpo", reward=["exact"], normalize_advantages=True)
