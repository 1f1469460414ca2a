"""PPO's equations against a plain-PyTorch reference written here from TRL's last ``PPOTrainer``
(``trl/experimental/ppo/ppo_trainer.py``: its padding masks, ``INVALID_LOGPROB``, k1 / k3 KL, the
score at ``actual_end``, ``masked_whiten``, the GAE loop, the clipped policy and value losses) run on
stock PEFT with the full logits and a separate value head: our rollout targets (KL, rewards,
advantages, returns), loss and every gradient (LoRA and value head) on the fused model, over two
accumulated micro-batches, agree to fp32 1e-5. A mutation check: each of several wrong settings
or code changes on our side makes the comparison fail."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_grpo import TARGETS, _lora_grads

from lorafuse.testing import assert_close
from lorafuse.train import ppo
from lorafuse.train.ppo import Episode, PPOObjective, pad_rows, rollout_targets, value_head

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
MAX_LEN, TEMPERATURE, N = 10, 0.7, 8
INVALID_LOGPROB = 1.0
BASE = dict(beta=0.05, gamma=1.0, lam=0.95, estimator="k1", whiten_rewards=False,
            cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorafuse import patch_peft_model
    from lorafuse.testing import save_tiny_model

    model_dir = tmp_path_factory.mktemp("tiny_ppo")
    save_tiny_model(model_dir, scale=1.0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    stock = get_peft_model(base, lora)
    ours = patch_peft_model(copy.deepcopy(stock))
    ppo.attach_value_head(ours)
    with torch.no_grad():  # values of order 1
        value_head(ours).weight.normal_(std=0.3)
    head = copy.deepcopy(value_head(ours))  # the reference's own value head
    rng = random.Random(0)
    prompts, completions = [], []
    for i in range(N):
        prompts.append([rng.randint(3, 120) for _ in range(rng.randint(2, 7))])
        n = MAX_LEN if i == 3 else rng.randint(1, MAX_LEN)  # one fills the grid: L = C
        ids = [rng.randint(3, 120) for _ in range(n)]
        if n < MAX_LEN and rng.random() < 0.6:
            ids[-1] = tok.eos_token_id
        completions.append(ids)
    scores = torch.randn(N, generator=torch.Generator().manual_seed(1))
    assert tok.pad_token_id != tok.eos_token_id
    return tok, stock, ours, head, prompts, completions, scores


# ---- the reference: TRL's tensor code, on TRL's layout ---------------------------------------------
def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def masked_var(values, mask):
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    return variance * (mask.sum() / (mask.sum() - 1))


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def _layout(prompts, completions, pad):
    """Queries left-padded, responses right-padded: (N, P + C) ids and mask, P, C."""
    P, C = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), P + C), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p) : P + len(c)] = torch.tensor(p + c)
        mask[i, P - len(p) : P + len(c)] = 1
    return ids, mask, P, C


def _forward(model, head, ids, mask, P):
    """Per response token: ``log softmax(logits / T)`` of it, and the value of the state before it."""
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    logits = out.logits[:, P - 1 : -1].float() / TEMPERATURE
    logprob = torch.gather(logits.log_softmax(-1), 2, ids[:, P:, None]).squeeze(-1)
    value = head(out.hidden_states[-1][:, P - 1 : -1].float()).squeeze(-1)
    return logprob, value


def reference_rollout(model, head, ids, mask, P, C, lengths, scores, s):
    with torch.no_grad():
        logprobs, values = _forward(model, head, ids, mask, P)
        with model.disable_adapter():
            ref_logprobs, _ = _forward(model, head, ids, mask, P)
    sequence_lengths = lengths - 1
    response_idxs = torch.arange(C).repeat(len(lengths), 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)
    logr = ref_logprobs - logprobs
    kl = -logr if s["estimator"] == "k1" else (logr.exp() - 1) - logr
    non_score_reward = -s["beta"] * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0))
    actual_end = torch.where(sequence_lengths_p1 < C, sequence_lengths_p1, sequence_lengths)
    rewards[actual_start, actual_end] += scores
    if s["whiten_rewards"]:
        rewards = masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
    lastgaelam = 0
    advantages_reversed = []
    for t in reversed(range(C)):
        nextvalues = values[:, t + 1] if t < C - 1 else 0.0
        delta = rewards[:, t] + s["gamma"] * nextvalues - values[:, t]
        lastgaelam = delta + s["gamma"] * s["lam"] * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return dict(logprobs=logprobs, values=values, kl=kl, rewards=rewards, advantages=advantages,
                returns=returns, padding_mask=padding_mask, padding_mask_p1=padding_mask_p1)  # fmt: skip


def reference_loss(model, head, ids, mask, P, r, inds, s):
    new_logprobs, vpred = _forward(model, head, ids[inds], mask[inds], P)
    new_logprobs = torch.masked_fill(new_logprobs, r["padding_mask"][inds], INVALID_LOGPROB)
    vpred = torch.masked_fill(vpred, r["padding_mask_p1"][inds], 0)
    mb_values, mb_return, mb_advantage = (
        r["values"][inds],
        r["returns"][inds],
        r["advantages"][inds],
    )
    vpredclipped = torch.clamp(vpred, mb_values - s["cliprange_value"],
                               mb_values + s["cliprange_value"])  # fmt: skip
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), ~r["padding_mask_p1"][inds])
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), ~r["padding_mask_p1"][inds])
    ratio = torch.exp(new_logprobs - r["logprobs"][inds])
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - s["cliprange"], 1.0 + s["cliprange"])
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), ~r["padding_mask"][inds])
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses).float(), ~r["padding_mask"][inds])
    loss = pg_loss + s["vf_coef"] * vf_loss
    return loss, dict(pg_loss=pg_loss, vf_loss=vf_loss, pg_clipfrac=pg_clipfrac,
                      vf_clipfrac=vf_clipfrac)  # fmt: skip


# ---- ours ------------------------------------------------------------------------------------------
def our_rollout(obj, model, prompts, completions, scores, s):
    episodes = [Episode(p, c) for p, c in zip(prompts, completions)]
    lengths = torch.tensor([len(c) for c in completions])
    C = int(lengths.max())
    model.eval()
    with torch.no_grad():
        lp, v, _ = obj.forward(model, episodes)
    ref, _, _ = obj.forward(model, episodes, reference=True)
    model.train()
    logps = pad_rows([lp[i, :L] for i, L in enumerate(lengths.tolist())], C, "cpu")
    refs = pad_rows([ref[i, :L] for i, L in enumerate(lengths.tolist())], C, "cpu")
    values = pad_rows([v[i, : min(L + 1, C)] for i, L in enumerate(lengths.tolist())], C, "cpu")
    t = rollout_targets(scores, logps, refs, values, lengths, beta=s["beta"], gamma=s["gamma"],
                        lam=s["lam"], estimator=s["estimator"],
                        whiten_rewards=s["whiten_rewards"])  # fmt: skip
    for i, e in enumerate(episodes):
        L, V = len(e.completion_ids), min(len(e.completion_ids) + 1, C)
        e.old_logps, e.values = logps[i, :L], values[i, :V]
        e.advantages, e.returns = t.advantages[i, :L], t.returns[i, :V]
    return episodes, t


def _perturb_lora(models, seed: int) -> None:
    """The same small step on every model's LoRA weights (by name, in name order)."""
    g = torch.Generator().manual_seed(seed)
    params = [sorted((n, p) for n, p in m.named_parameters() if "lora_" in n) for m in models]
    with torch.no_grad():
        for named in zip(*params):
            (n, p), *rest = named
            delta = torch.randn(p.shape, generator=g) * 0.3 * p.abs().mean()
            assert all(m == n for m, _ in rest)
            for _, q in named:
                q.add_(delta)


def compare(setup, s, ours_s=None, perturb=False, inds=(5, 0, 3, 6, 1, 7)):
    """Our figures vs the reference's under settings ``s`` (ours under ``ours_s``, a mutation, when
    given): ``{name: (ours, reference, mask)}`` for :func:`mismatches`."""
    tok, stock, ours, head, prompts, completions, scores = setup
    ours_s = ours_s or s
    saved = {(id(m), n): p.detach().clone() for m in (stock, ours)
             for n, p in m.named_parameters() if p.requires_grad}  # fmt: skip
    saved_head = head.weight.detach().clone()
    try:
        ids, mask, P, C = _layout(prompts, completions, tok.pad_token_id)
        lengths = torch.tensor([len(c) for c in completions])
        r = reference_rollout(stock, head, ids, mask, P, C, lengths, scores, s)
        obj = PPOObjective(ours_s["cliprange"], ours_s["cliprange_value"], ours_s["vf_coef"],
                           TEMPERATURE, tok.pad_token_id)  # fmt: skip
        episodes, t = our_rollout(obj, ours, prompts, completions, scores, ours_s)
        if perturb:  # a later minibatch: π ≠ π_old and the values moved, some tokens clip
            _perturb_lora([stock, ours], seed=7)
            with torch.no_grad():
                shift = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(3))
                for w in (head.weight, value_head(ours).weight):
                    w.add_(0.5 * shift * w.abs().mean())
        inds = list(inds)
        ref_loss, parts = reference_loss(stock, head, ids, mask, P, r, inds, s)
        ref_loss.backward()
        ref_grads = _lora_grads(stock)
        ref_grads["value_head"] = head.weight.grad.clone()
        head.weight.grad = None
        mb = [episodes[i] for i in inds]
        counts = obj.counts(mb)
        loss, sums = 0.0, 0.0
        for part in (mb[:4], mb[4:]):  # two accumulated micro-batches = the minibatch
            lo, su = obj.loss(ours, part, counts)
            lo.backward()
            loss, sums = loss + lo.detach(), sums + su
        grads = _lora_grads(ours)
        grads["value_head"] = grads.pop("base_model.model.value_head.weight")
        valid, vvalid = (~r["padding_mask"]).float(), (~r["padding_mask_p1"]).float()
        out = {k: (getattr(t, k), r[k], m) for k, m in (("kl", valid), ("rewards", vvalid),
               ("advantages", valid), ("returns", vvalid))}  # fmt: skip
        out["loss"] = (loss, ref_loss.detach(), None)
        out.update({f"grad {k}": (grads.get(k), ref_grads[k], None) for k in ref_grads})
        metrics = obj.metrics(sums, counts)
        out["clipfracs"] = (torch.tensor([metrics["policy/clipfrac"], metrics["val/clipfrac"]]),
                            torch.tensor([float(parts["pg_clipfrac"]),
                                          float(parts["vf_clipfrac"])]), None)  # fmt: skip
        return out
    finally:
        with torch.no_grad():
            for m in (stock, ours):
                for n, p in m.named_parameters():
                    if p.requires_grad:
                        p.copy_(saved[(id(m), n)])
            head.weight.copy_(saved_head)
            value_head(ours).weight.copy_(saved_head)


def mismatches(figures) -> list[str]:
    """Names of the figures that differ by more than fp32 1e-5 (relative to their scale)."""
    bad = []
    for name, (a, b, m) in figures.items():
        if a is None or a.shape != b.shape:
            bad.append(name)
            continue
        if m is not None:
            a, b = a * m, b * m
        scale = max(b.abs().max().item(), 1e-3)
        if not torch.allclose(a, b, atol=1e-5 * scale, rtol=1e-5):
            bad.append(name)
    return bad


CASES = [
    dict(BASE),
    dict(BASE, estimator="k3", whiten_rewards=True, gamma=0.9, lam=0.8, perturb=True),
    dict(BASE, beta=0.0, lam=1.0, cliprange=0.1, cliprange_value=0.05, vf_coef=0.5, perturb=True),
]


@pytest.mark.parametrize("case", CASES, ids=["default", "k3-whiten-gae", "clips"])
def test_equal_to_the_reference(setup, case):
    s = dict(case)
    perturb = s.pop("perturb", False)
    figures = compare(setup, s, perturb=perturb)
    for name, (a, b, m) in figures.items():
        if a is not None and m is not None:
            a, b = a * m, b * m
        if a is not None and a.shape == b.shape:
            scale = max(b.abs().max().item(), 1e-3)
            assert_close(a, b, atol=1e-5 * scale, rtol=1e-5, name=name)
    assert not mismatches(figures)
    assert (
        figures["advantages"][1].abs().max() > 0.1 and figures["grad value_head"][1].abs().max() > 0
    )
    if perturb:  # the clipped branches were exercised
        assert (figures["clipfracs"][1] > 0).all(), figures["clipfracs"]


def _gae_off_by_one(rewards, values, gamma, lam):
    adv, ret = GAE(rewards, values, gamma, lam)
    return adv, adv + torch.roll(values, 1, 1)


def _biased_whiten(x, mask, shift_mean=True):
    mean = (x * mask).sum() / mask.sum()
    out = (x - mean) * torch.rsqrt(((x - mean) ** 2 * mask).sum() / mask.sum() + 1e-8)
    return out if shift_mean else out + mean


GAE, WHITEN = ppo.gae, ppo.masked_whiten
MUTATIONS = [
    ("lam", dict(lam=0.9), None, "advantages"),
    ("gamma", dict(gamma=0.97), None, "advantages"),
    ("kl estimator", dict(estimator="k1"), None, "kl"),
    ("whitening", dict(whiten_rewards=False), None, "rewards"),
    ("cliprange", dict(cliprange=0.1), None, "loss"),
    ("cliprange_value", dict(cliprange_value=0.05), None, "loss"),
    ("vf_coef", dict(vf_coef=0.2), None, "loss"),
    ("returns", {}, ("gae", _gae_off_by_one), "returns"),
    ("biased var", {}, ("masked_whiten", _biased_whiten), "advantages"),
]


@pytest.mark.parametrize("name, change, code, caught", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_mutation_is_caught(setup, monkeypatch, name, change, code, caught):
    s = dict(CASES[1])
    s.pop("perturb")
    if code is not None:
        monkeypatch.setattr(ppo, code[0], code[1])
    bad = mismatches(compare(setup, s, dict(s, **change), perturb=True))
    assert caught in bad, (name, bad)
