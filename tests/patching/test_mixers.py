"""The hybrids' token mixers on lorafuse's ops (:mod:`lorafuse.patching.mixers`), fp32:

* one example per row, no padding: logits and every LoRA gradient against an fp64 run no further
  than stock transformers + PEFT (the whole lorafuse patch), the loss equal to stock's; bf16
  logits as close to the fp32 oracle as stock's;
* padded batches (left-padded as generation pads, right-padded as eval pads): every row's real
  positions equal its prompt alone, so padding never feeds a recurrent or conv state;
* the boundaries themselves (:func:`lorafuse.patching.segments.find`), and a stateful mixer that
  lorafuse does not patch turning packing off with its reason.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from lorafuse import patch_peft_model, unpatch_peft_model
from lorafuse.models.capabilities import packing_supported
from lorafuse.patching import mixers, segments
from lorafuse.testing.new_families import FAMILY_CASES, build_family_model
from lorafuse.testing.numerics import (
    assert_as_accurate_as_stock,
    assert_fp32_as_accurate_as_stock,
    fp32_oracle,
    fp64_oracle,
)

HYBRIDS = sorted(
    a for a in FAMILY_CASES if a.startswith(("Qwen3_5", "Qwen3Next", "Lfm2", "GraniteMoeHybrid"))
)


def _peft(arch: str):
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=FAMILY_CASES[arch][3])
    model = peft.get_peft_model(build_family_model(arch), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(
                    torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.05
                )
    return model


def _rel(name, a, e, close, tol=1e-5):
    close(a, e, atol=tol * e.abs().max().item(), rtol=tol, name=name)


def _rms(a, b) -> float:
    return ((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()


# Qwen3-Next, watched (issue 49): its logits passed and failed this bound on one commit across
# full-suite runs (rounding order: the C++ RMSNorm's sum order); file runs now pass. Not strict.
@pytest.mark.parametrize("arch", [
    pytest.param(a, marks=pytest.mark.xfail(strict=False, reason="Qwen3-Next drift, issue 49"))
    if a == "Qwen3NextForCausalLM" else a for a in HYBRIDS])  # fmt: skip
def test_one_example_per_row_equals_stock(arch, close):
    stock, ours = _peft(arch), _peft(arch)
    oracle = fp64_oracle(stock)  # our mixers' torch path in fp64 (stock's casts to fp32)
    patch_peft_model(ours)
    assert any("boundaries" in k for k in ours.lorafuse_report.fast_paths), ours.lorafuse_report
    ids = torch.randint(3, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (ours, stock, oracle)]
    assert_fp32_as_accurate_as_stock(*logits, name="logits")
    losses = []
    for m in (stock, ours, oracle):
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    _rel("loss", losses[1], losses[0], close)
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad}
             for m in (stock, ours, oracle)]  # fmt: skip
    assert grads[0].keys() == grads[1].keys() and grads[0]
    # fp32 is itself noisy on the gradients through Gated DeltaNet's log decay (in_proj_a/b: the
    # chunk's cumulative log decays, -100s, are differenced): stock is up to 2e-5 (rms) from an
    # fp64 run there, and rounding-level differences (the conv's summation order) move them as
    # much, so ours and stock are each held against the fp64 run (issue 49's fp32 rule).
    for n, g_stock in grads[0].items():  # the oracle itself is sane
        assert _rms(g_stock, grads[2][n]) < 1e-4, f"{n}: the fp64 run is far from stock"
    assert_fp32_as_accurate_as_stock(grads[1], grads[0], grads[2], name="LoRA gradients")


# The MoE twins' mixers (Qwen3.5-MoE, LFM2-MoE) are copies of Qwen3.5's and LFM2's.
@pytest.mark.parametrize(
    "arch", sorted(set(HYBRIDS) - {"Qwen3_5MoeForCausalLM", "Lfm2MoeForCausalLM"})
)
def test_bf16_as_accurate_as_stock(arch):
    stock = build_family_model(arch).bfloat16()
    oracle, ours = fp32_oracle(stock), copy.deepcopy(stock)
    mixers.install(ours)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [m(input_ids=ids, use_cache=False).logits for m in (ours, stock, oracle)]
    assert_as_accurate_as_stock(*logits, name=f"{arch} bf16 logits")


def _padded(lengths, left: bool):
    """ids, mask, positions (B, W) for prompts of ``lengths``, padded with token 0."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        cols = slice(width - len(p), width) if left else slice(0, len(p))
        ids[i, cols], mask[i, cols] = p, 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # generation's positions: each row from its start
    return prompts, ids, mask, pos


# Biases make padding feed a state even after transformers zeroes the padded hidden states: the
# conv reads in_proj's bias at every padded position (stock leaks there; so would we without the
# padding boundaries).
BIASES = {"Lfm2ForCausalLM": dict(conv_bias=True), "Lfm2MoeForCausalLM": dict(conv_bias=True),
          "GraniteMoeHybridForCausalLM": dict(mamba_proj_bias=True, mamba_conv_bias=True)}  # fmt: skip


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("padding", ["left", "left+positions", "right"])
def test_padded_rows_equal_each_prompt_alone(arch, padding, close):
    model = build_family_model(arch, **BIASES.get(arch, {}))
    with torch.no_grad():  # transformers initialises biases to zero
        for n, p in model.named_parameters():
            if n.endswith(".bias") and ("mamba" in n or ".conv." in n):
                p.normal_(0, 1.0)
    mixers.install(model)
    prompts, ids, mask, pos = _padded([13, 4, 9], left=padding != "right")
    with torch.no_grad():
        extra = {"position_ids": pos} if padding == "left+positions" else {}
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra).logits
        for i, p in enumerate(prompts):
            alone = model(input_ids=p[None], use_cache=False).logits[0]
            cols = mask[i].bool()  # (without positions RoPE sees a shift: relative, no change)
            _rel(f"row {i}", out[i, cols], alone, close)


def test_segments_from_restarts_and_padding():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    seg = segments.find(pos, None, 2, 6)
    assert seg.cu_seqlens.tolist() == [0, 3, 5, 6, 12]
    assert seg.row_first.tolist() == [0, 3] and seg.row_last.tolist() == [2, 3]
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding
    seg = segments.find(None, mask, 2, 5)
    assert seg.cu_seqlens.tolist() == [0, 2, 5, 10] and seg.row_last.tolist() == [1, 2]
    mask = torch.tensor([[1, 1, 1, 0, 0]])  # right padding: the real example is the cached one
    assert segments.find(None, mask, 1, 5).row_last.tolist() == [0]
    assert segments.find(pos[1:], torch.ones(1, 6), 1, 6) is None  # one sequence, no padding
    assert segments.find(None, mask, 1, 1) is None  # a decoding step is never split
    states = torch.arange(2.0)[:, None]
    seg = segments.find(pos, None, 2, 6)
    assert seg.initial(states).squeeze(1).tolist() == [0, 0, 0, 1]  # row 1 continues its state


def test_unpatched_stateful_mixer_turns_packing_off():
    model = build_family_model("Lfm2ForCausalLM")
    mixers.install(model)
    assert packing_supported(model) == (True, "sdpa")
    assert mixers.uninstall(model) == 4  # the decoder model and three short convs
    ok, why = packing_supported(model)
    assert not ok and "Lfm2ShortConv (3 module(s)" in why, why


def test_unpatch_restores_the_stock_mixers():
    model = _peft("Qwen3_5ForCausalLM")
    patch_peft_model(model)
    unpatch_peft_model(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
