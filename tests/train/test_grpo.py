"""GRPO: on the same prompts, completions and rewards, our advantages, loss and every LoRA gradient
equal TRL's ``GRPOTrainer`` (its own ``_generate_and_score_completions`` and ``_compute_loss``, with
generation replaced by the fixed completions) for each loss type; TRL's trainer on a patched model
equals stock; accumulation over micro-batches equals one big batch."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from lorafuse.testing import assert_close
from lorafuse.train.grpo import (
    GRPOObjective,
    Sample,
    group_advantages,
    nanstd,
)
from lorafuse.train.rewards import Reward, combine, score

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
G, MAX_LEN, TEMPERATURE = 4, 12, 0.7


def _odd_tokens(prompts, completions, completion_ids, **kw):
    return [float(sum(t % 2 for t in ids)) / 4 for ids in completion_ids]


def _has_answer(prompts, completions, completion_ids, answer, **kw):
    # None ("does not apply") for the prompts whose answer is "skip"
    return [None if a == "skip" else float(int(a) in ids) for ids, a in zip(completion_ids, answer)]


REWARDS = [Reward("odd", _odd_tokens, 1.0), Reward("answer", _has_answer, 0.5)]


def _completions(tok, n_prompts: int) -> list[list[int]]:
    """Random completions of mixed lengths (some end with EOS, some hit MAX_LEN); prompt 2's
    group is four copies of one completion: a zero-std group."""
    rng = random.Random(0)
    out = []
    for p in range(n_prompts):
        for _ in range(G):
            n = rng.randint(1, MAX_LEN)
            ids = [rng.randint(3, 120) for _ in range(n)]
            if n < MAX_LEN and rng.random() < 0.7:
                ids[-1] = tok.eos_token_id
            out.append(ids)
        if p == 2:
            out[-G:] = [out[-G]] * G
    return out


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
    from trl import GRPOConfig, GRPOTrainer

    from lorafuse import patch_peft_model
    from lorafuse.testing import save_tiny_model

    model_dir = tmp_path_factory.mktemp("tiny_grpo")
    save_tiny_model(model_dir, scale=1.0)  # moderate logits: the test measures the loss
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
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], use_cpu=True,
                      bf16=False, gradient_checkpointing=False, num_generations=G,
                      per_device_train_batch_size=len(prompts) * G, max_completion_length=MAX_LEN,
                      temperature=TEMPERATURE, reward_weights=[r.weight for r in REWARDS])  # fmt: skip
    ds = Dataset.from_list([{"prompt": p, "answer": a} for p, a in zip(prompts, answers)])
    trainer = GRPOTrainer(model=load(), reward_funcs=[r.fn for r in REWARDS], args=args,
                          train_dataset=ds, processing_class=tok,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))  # fmt: skip
    result = set_peft_model_state_dict(trainer.model, get_peft_model_state_dict(stock))
    assert not result.unexpected_keys
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which we skip
    data = dict(prompts=prompts, answers=answers, prompt_ids=prompt_ids, completions=completions)
    return tok, data, trainer, stock, ours


def _trl_inputs(trainer, tok, data):
    """TRL's generation batch for the fixed completions: its own padding, rewards, advantages,
    old and reference log-probs (generation replaced by the data)."""
    P = [ids for ids in data["prompt_ids"] for _ in range(G)]
    texts = tok.batch_decode(data["completions"], skip_special_tokens=True)

    def fixed(prompts):
        return P, data["completions"], None, texts, None, {}, None, []

    trainer._generate = fixed
    inputs = [{"prompt": p, "answer": a} for p, a in zip(data["prompts"], data["answers"])
              for _ in range(G)]  # fmt: skip
    return trainer._generate_and_score_completions(inputs)


def _our_samples(obj, model, tok, data, scale):
    prompts = [p for p in data["prompts"] for _ in range(G)]
    texts = tok.batch_decode(data["completions"], skip_special_tokens=True)
    columns = {"answer": [a for a in data["answers"] for _ in range(G)],
               "completion_ids": data["completions"]}  # fmt: skip
    _, per = score(REWARDS, prompts, texts, columns)
    adv, zero = group_advantages(combine(REWARDS, per), G, scale)
    samples = [Sample(data["prompt_ids"][i // G], c, float(a))
               for i, (c, a) in enumerate(zip(data["completions"], adv))]  # fmt: skip
    return samples, adv, zero


def _lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n.replace(".default", ""): p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
    model.zero_grad(set_to_none=True)
    return grads


def _perturb(models, seed: int) -> None:
    """The same small step on every model's LoRA weights: π ≠ π_old, some ratios clipped."""
    g = torch.Generator().manual_seed(seed)
    names = sorted(n.replace(".default", "") for n, p in models[0].named_parameters()
                   if p.requires_grad)  # fmt: skip
    deltas = {}
    for n, p in sorted((n.replace(".default", ""), p) for n, p in models[0].named_parameters()
                       if p.requires_grad):  # fmt: skip
        deltas[n] = torch.randn(p.shape, generator=g) * 0.3 * p.detach().abs().mean()
    assert names == sorted(deltas)
    with torch.no_grad():
        for m in models:
            for n, p in m.named_parameters():
                if p.requires_grad:
                    p.add_(deltas[n.replace(".default", "")])


CASES = [  # loss_type, beta, epsilon, epsilon_high, num_iterations, scale_rewards, KL × ratio
    ("grpo", 0.0, 0.2, 0.2, 1, "group", True),
    ("grpo", 0.04, 0.2, 0.28, 2, "group", True),
    ("grpo", 0.04, 0.2, 0.28, 2, "group", False),
    ("dapo", 0.0, 0.2, 0.28, 2, "batch", True),
    ("dapo", 0.1, 0.1, 0.3, 1, "group", True),
    ("dr_grpo", 0.04, 0.2, 0.2, 2, "none", True),
    ("cispo", 0.0, 0.2, 1.02, 2, "group", True),  # epsilon_high: cispo's bound on ρ itself
    ("cispo", 0.04, 0.2, 5.0, 1, "group", True),
    ("sapo", 0.04, 0.2, 0.2, 2, "group", True),
    ("sapo", 0.0, 0.2, 0.2, 1, "batch", True),
]
SAPO_TEMPERATURES = (0.9, 1.3)  # (A > 0, A <= 0): unequal, so the choice per sign is checked


CLIP_KEYS = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]


@pytest.mark.parametrize("loss_type, beta, eps, eps_high, iters, scale, kl_corr", CASES)
def test_grpo_loss_and_grads_equal_trl(setup, loss_type, beta, eps, eps_high, iters, scale,
                                       kl_corr):  # fmt: skip
    tok, data, trl, stock, ours = setup
    saved = {n: p.detach().clone() for m in (trl.model, stock, ours)
             for n, p in [(f"{id(m)}{n}", p) for n, p in m.named_parameters() if p.requires_grad]}  # fmt: skip
    trl.loss_type, trl.beta, trl.epsilon_low, trl.epsilon_high = loss_type, beta, eps, eps_high
    trl.num_iterations, trl.scale_rewards = iters, scale
    trl.args.use_bias_correction_kl = kl_corr
    trl.args.sapo_temperature_pos, trl.args.sapo_temperature_neg = SAPO_TEMPERATURES
    trl._metrics["train"].clear()
    try:
        inputs = _trl_inputs(trl, tok, data)
        assert ("old_per_token_logps" in inputs) == (iters > 1)
        assert ("ref_per_token_logps" in inputs) == (beta > 0)
        obj = GRPOObjective(
            loss_type,
            beta,
            eps,
            eps_high,
            MAX_LEN,
            TEMPERATURE,
            tok.pad_token_id,
            kl_correction=kl_corr,
            sapo_temperatures=SAPO_TEMPERATURES,
        )
        per_model = {}
        for name, model in (("stock", stock), ("lorafuse", ours)):
            samples, adv, zero = _our_samples(obj, model, tok, data, scale)
            assert_close(adv, inputs["advantages"], atol=1e-6, rtol=1e-6, name="advantages")
            assert trl._metrics["train"]["frac_reward_zero_std"][-1] == pytest.approx(
                zero.float().mean().item()
            )
            if iters > 1:
                for s, lp in zip(samples, obj.logps(model, samples)):
                    s.old_logps = lp
            if beta:
                for s, lp in zip(samples, obj.logps(model, samples, reference=True)):
                    s.ref_logps = lp
            per_model[name] = samples
        if iters > 1:  # a later iteration over the same generation batch: ratios move, some clip
            _perturb([trl.model, stock, ours], seed=len(loss_type) + iters)
        ref_loss = trl._compute_loss(trl.model, inputs)
        ref_loss.backward()
        ref_grads = _lora_grads(trl.model)
        for name, model in (("stock", stock), ("lorafuse", ours)):
            samples = per_model[name]
            if iters > 1:  # TRL's π_old, scored by TRL, against ours
                C = inputs["completion_ids"].shape[1]
                mine = torch.stack([torch.nn.functional.pad(s.old_logps, (0, C - len(s.old_logps)))
                                    for s in samples])  # fmt: skip
                m = inputs["completion_mask"].bool()
                assert_close(mine[m], inputs["old_per_token_logps"][m], atol=1e-5, rtol=1e-5,
                             name="old logps")  # fmt: skip
            counts = obj.counts(samples)
            loss, sums = obj.loss(model, samples, counts)
            loss.backward()
            grads = _lora_grads(model)
            metrics = obj.metrics(sums, counts)
            assert_close(
                loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5, name=f"{name} loss"
            )
            assert grads.keys() == ref_grads.keys() and grads
            for k in grads:
                scale_k = ref_grads[k].abs().max().item()
                assert_close(grads[k], ref_grads[k], atol=1e-5 * scale_k, rtol=1e-5, name=k)
            clip_keys = {"cispo": ["cispo_clip_ratio"], "sapo": []}.get(loss_type, CLIP_KEYS)
            assert sorted(k for k in metrics if k != "kl") == sorted(clip_keys)
            for key in clip_keys:
                assert metrics[key] == pytest.approx(trl._metrics["train"][key][-1], abs=1e-6)
            if beta:
                assert metrics["kl"] == pytest.approx(trl._metrics["train"]["kl"][-1], rel=1e-4)
        if iters > 1 and loss_type != "sapo":  # clipping is exercised
            key = "cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/region_mean"
            assert trl._metrics["train"][key][-1] > 0
    finally:
        with torch.no_grad():
            for m in (trl.model, stock, ours):
                for n, p in m.named_parameters():
                    if p.requires_grad:
                        p.copy_(saved[f"{id(m)}{n}"])


def test_trl_grpo_on_a_patched_model_equals_stock(setup):
    """TRL's own loss code on ``patch_peft_model(trl.model)`` gives stock's loss and gradients."""
    from lorafuse import patch_peft_model

    tok, data, trl, _, _ = setup
    trl.loss_type, trl.beta, trl.num_iterations, trl.scale_rewards = "dapo", 0.04, 1, "group"
    trl.epsilon_low = trl.epsilon_high = 0.2
    inputs = _trl_inputs(trl, tok, data)
    ref = trl._compute_loss(trl.model, inputs)
    ref.backward()
    ref_grads = _lora_grads(trl.model)
    stock_model = trl.model
    trl.model = patched = patch_peft_model(copy.deepcopy(stock_model))
    try:
        loss = trl._compute_loss(patched, inputs)
        loss.backward()
    finally:
        trl.model = stock_model
    grads = _lora_grads(patched)
    assert_close(loss.detach(), ref.detach(), atol=1e-5, rtol=1e-5, name="loss")
    for k in grads:
        scale_k = ref_grads[k].abs().max().item()
        assert_close(grads[k], ref_grads[k], atol=1e-5 * scale_k, rtol=1e-5, name=k)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
def test_accumulation_equals_one_big_batch(setup, loss_type):
    tok, data, _, _, ours = setup
    obj = GRPOObjective(loss_type, 0.04, 0.2, 0.28, MAX_LEN, TEMPERATURE, tok.pad_token_id)
    samples, _, _ = _our_samples(obj, ours, tok, data, "group")
    for s, lp in zip(samples, obj.logps(ours, samples, reference=True)):
        s.ref_logps = lp
    counts = obj.counts(samples)
    big, sums_big = obj.loss(ours, samples, counts)
    big.backward()
    want = _lora_grads(ours)
    total, sums = torch.zeros(()), 0.0
    for mb in (samples[:3], samples[3:9], samples[9:]):  # uneven micro-batches
        loss, s = obj.loss(ours, mb, counts)
        loss.backward()
        total, sums = total + loss.detach(), sums + s
    got = _lora_grads(ours)
    assert_close(total, big.detach(), atol=1e-6, rtol=1e-5, name="loss")
    assert_close(sums, sums_big, atol=1e-5, rtol=1e-5, name="metric sums")
    for k in want:
        assert_close(got[k], want[k], atol=1e-6 * want[k].abs().max().item(), rtol=1e-5, name=k)


def test_padding_samples_change_nothing(setup):
    tok, data, _, _, ours = setup
    obj = GRPOObjective("grpo", 0.0, 0.2, 0.2, MAX_LEN, TEMPERATURE, tok.pad_token_id)
    samples, _, _ = _our_samples(obj, ours, tok, data, "group")
    a, _ = obj.loss(ours, samples[:5], obj.counts(samples[:5]))
    pad = Sample(samples[0].prompt_ids, samples[0].completion_ids, 0.0, n_examples=0)
    padded = samples[:5] + [pad]
    b, _ = obj.loss(ours, padded, obj.counts(padded))
    assert_close(b.detach(), a.detach(), atol=1e-7, rtol=1e-6, name="loss")


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0, 3.0, float("nan"), 1.0, 2.0])
    adv, zero = group_advantages(r, 4, "group")
    g0 = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert_close(adv[:4], (g0 - 0.5) / (g0.std() + 1e-4), atol=1e-6, rtol=1e-6, name="group 0")
    assert torch.equal(adv[4:8], torch.zeros(4)) and zero[4:8].all() and not zero[:4].any()
    assert adv[9] == 0.0  # unscorable: no advantage
    assert_close(adv[[8, 10, 11]], (torch.tensor([3.0, 1.0, 2.0]) - 2.0) / (1.0 + 1e-4),
                 atol=1e-6, rtol=1e-6, name="group 2 without the NaN")  # fmt: skip
    none, _ = group_advantages(r, 4, "none")
    assert_close(none[:4], g0 - 0.5, atol=0, rtol=0, name="unscaled")
    batch, _ = group_advantages(r, 4, "batch")
    assert_close(batch[:4], (g0 - 0.5) / (nanstd(r) + 1e-4), atol=1e-6, rtol=1e-6, name="batch")


def test_combine_weights_and_leaves_out_unscorable():
    rewards = [Reward("a", None, 1.0), Reward("b", None, 0.5)]
    nan = float("nan")
    total = combine(rewards, [[1.0, nan, nan], [2.0, 4.0, nan]])
    assert total[:2].tolist() == [2.0, 2.0] and torch.isnan(total[2])  # all None: no reward
