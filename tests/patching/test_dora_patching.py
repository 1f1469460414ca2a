"""patch_peft_model on PEFT DoRA adapters (use_dora=True): the fused DoRA op equals stock PEFT DoRA
on a tiny Llama (loss, every gradient, dropout, AdamW steps), NF4 bases (QDoRA), the report."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from lorafuse import patch_peft_model
from lorafuse.models.nf4 import Linear4bit
from lorafuse.patching.peft_lora import is_fused_lora, runs_dora
from lorafuse.testing import assert_close, single_thread, tiny_llama_config

ATOL, RTOL = 1e-5, 1e-5  # fp32: the same products in another association (tests/ops/test_dora.py)
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _one_thread():
    yield from single_thread()  # tiny shapes: threads only add barrier waits on a shared box


def _dora_llama(dropout=0.0, seed=0, targets=ALL7):
    """A tiny Llama with a DoRA adapter whose B and magnitude are not at their init (B = 0 and
    m = ||W|| make every DoRA factor m/n exactly 1)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(tiny_llama_config())
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=targets,
                          use_dora=True)  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "lora_magnitude_vector" in name:
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
    return model


def _tokens(seed=1, batch=2, seq=12):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_patched_dora_matches_stock_loss_and_every_gradient(dropout):
    stock = _dora_llama(dropout)
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    report = fused.lorafuse_report
    assert report.n_patched == report.n_lora == 14 and not report.skipped
    assert any("fused DoRA on 14 module(s)" in n for n in report.notes), report.notes
    assert all(runs_dora(m) for m in fused.modules() if is_fused_lora(m))
    ids = _tokens()
    out = {}
    for tag, m in (("stock", stock), ("fused", fused)):
        torch.manual_seed(42)  # the same dropout draws
        loss = _loss(m, ids)
        loss.backward()
        out[tag] = (loss.detach(), _grads(m))
    assert_close(out["fused"][0], out["stock"][0], atol=ATOL, rtol=RTOL, name="loss")
    gs, gf = out["stock"][1], out["fused"][1]
    assert gs.keys() == gf.keys()
    assert sum("lora_magnitude_vector" in n for n in gf) == 14
    for n in gs:
        assert_close(gf[n], gs[n], atol=ATOL, rtol=RTOL, name=n)


def test_patched_dora_adamw_steps_match_stock():
    stock = _dora_llama()
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
            for m in (stock, fused)]  # fmt: skip
    for step in range(5):
        ids = _tokens(seed=step)
        losses = []
        for m, opt in zip((stock, fused), opts):
            opt.zero_grad()
            loss = _loss(m, ids)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        # as tests/patching/test_peft_lora.py: Adam amplifies ulp differences of near-cancelling
        # gradient elements up to O(lr) per step; lr = 1e-3 keeps that inside 1e-5 over 5 steps
        assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-4, name=f"loss step {step}")
    ws = dict(stock.named_parameters())
    for n, p in fused.named_parameters():
        if "lora_" in n:
            rel = ((p - ws[n]).norm() / ws[n].norm()).item()
            assert rel < 1e-4, f"{n}: relative difference {rel:.2e} after 5 AdamW steps"


def test_dora_30_step_convergence_tracks_stock():
    """30 AdamW steps at a training learning rate (2e-3) on one repeated batch: the loss falls,
    and the fused run's loss stays within 1e-5 relative of stock's at every step (measured max
    2.1e-7: the same math, differing in rounding only, which Adam can amplify)."""
    stock = _dora_llama(dropout=0.1)
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=2e-3)
            for m in (stock, fused)]  # fmt: skip
    ids = _tokens(seed=7, batch=4, seq=16)
    curves = ([], [])
    for step in range(30):
        for m, opt, curve in zip((stock, fused), opts, curves):
            torch.manual_seed(1000 + step)  # the same dropout draws in both runs
            opt.zero_grad()
            loss = _loss(m, ids)
            loss.backward()
            opt.step()
            curve.append(loss.item())
    stock_curve, fused_curve = (torch.tensor(c, dtype=torch.float64) for c in curves)
    rel = ((fused_curve - stock_curve).abs() / stock_curve).max().item()
    assert rel < 1e-5, f"fused loss curve {rel:.2e} (max relative) from stock's"
    assert fused_curve[-1] < 0.9 * fused_curve[0], "the loss did not fall: the test is vacuous"


def test_qdora_nf4_base_matches_stock_dora_on_the_dequantized_base():
    """QDoRA: DoRA adapters over lorafuse's NF4 Linear4bit bases, patched, equal stock PEFT DoRA
    whose dense base weights hold the dequantized NF4 values (stock PEFT cannot run DoRA on the
    NF4 weight object itself: its DoRA reads ``base_layer.weight`` as a Parameter)."""
    stock = _dora_llama()
    fused = copy.deepcopy(stock)
    for (_, s), (_, f) in zip(stock.named_modules(), fused.named_modules()):
        if isinstance(f, peft.tuners.lora.layer.Linear):
            f.base_layer = Linear4bit(f.base_layer)
            with torch.no_grad():
                s.base_layer.weight.copy_(f.base_layer.weight.dequantize(torch.float32))
    patch_peft_model(fused, backend="torch")
    assert fused.lorafuse_report.n_patched == 14
    ids = _tokens()
    ls, lf = _loss(stock, ids), _loss(fused, ids)
    assert_close(lf, ls, atol=ATOL, rtol=RTOL, name="loss")
    ls.backward()
    lf.backward()
    gs, gf = _grads(stock), _grads(fused)
    assert gs.keys() == gf.keys()
    for n in gs:
        assert_close(gf[n], gs[n], atol=ATOL, rtol=RTOL, name=n)


def test_dora_made_active_after_patching_runs_fused_dora():
    """A DoRA adapter switched on after patching takes the fused DoRA op (no warning)."""
    model = _dora_llama(targets=["q_proj"])
    model.add_adapter("plain", peft.LoraConfig(r=4, target_modules=["q_proj"]))
    model.set_adapter("plain")
    stock = copy.deepcopy(model)
    fused = patch_peft_model(model, backend="torch")
    fused.set_adapter("default")
    stock.set_adapter("default")
    ids = _tokens()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            got = fused(ids).logits
    with torch.no_grad():
        assert_close(got, stock(ids).logits, atol=ATOL, rtol=RTOL, name="logits")


def test_phi3_stacked_qkv_and_gate_up_run_per_linear_fused_dora():
    """Phi-3: one qkv_proj and one gate_up_proj per layer. Their DoRA norms are per output row of
    the stacked weight, so lora_mlp's gate/up halves cannot take them: each stacked projection is
    its own fused DoRA Linear (the MLP fast path hands the call to the module), equal to stock."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                        partial_rotary_factor=0.5)  # fmt: skip
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    stock = peft.get_peft_model(tf.Phi3ForCausalLM(cfg),
                                peft.LoraConfig(r=8, target_modules=targets, use_dora=True))  # fmt: skip
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    report = fused.lorafuse_report
    assert report.n_patched == 8 and any("fused DoRA on 8 module(s)" in n for n in report.notes)
    ids = _tokens()
    ls, lf = _loss(stock, ids), _loss(fused, ids)
    assert_close(lf, ls, atol=ATOL, rtol=RTOL, name="loss")
    ls.backward()
    lf.backward()
    gs, gf = _grads(stock), _grads(fused)
    assert gs.keys() == gf.keys()
    for n in gs:
        assert_close(gf[n], gs[n], atol=ATOL, rtol=RTOL, name=n)
