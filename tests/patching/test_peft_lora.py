"""patch_peft_model on generic PEFT LoRA Linear layers: same numbers as stock PEFT, same semantics."""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch
from torch import nn

from lorafuse import patch_peft_model, unpatch_peft_model
from lorafuse.patching import PatchReport
from lorafuse.patching.peft_lora import is_fused_lora
from lorafuse.testing import assert_close, tiny_llama_config

# fp32 tolerances: the fused backward brackets the rank-r products differently from autograd
# ((g·B)·s vs (g·s)·B), so results differ by a few ulps per op (~1e-7 relative); 1e-5 leaves
# headroom for the accumulation over two layers without hiding a wrong formula (errors of a
# missing scaling or dropout are O(1)).
ATOL, RTOL = 1e-5, 1e-5
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama_peft(dropout=0.0, seed=0, **lora_kwargs):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(tiny_llama_config())
    cfg = peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=dropout, target_modules=ALL7, **lora_kwargs
    )
    model = peft.get_peft_model(base, cfg)
    _randomize_lora_B(model)
    return model


def _randomize_lora_B(model):
    """PEFT zero-inits B, which would make every LoRA gradient but dB vanish: not a real test."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _mlp_peft(dropout=0.0, bias="none"):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 16))
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0", "2"], bias=bias
    )
    model = peft.get_peft_model(base, cfg)
    _randomize_lora_B(model)
    return model


def _tokens(batch=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g)


def _loss(model, ids):
    if isinstance(model.get_base_model(), nn.Sequential):
        return model(ids).pow(2).mean()
    return model(input_ids=ids, labels=ids).loss


def _inputs(model, seed=1):
    if isinstance(model.get_base_model(), nn.Sequential):
        return torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(seed))
    return _tokens(seed=seed)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [_llama_peft, _mlp_peft], ids=["llama", "mlp"])
def test_forward_and_grads_match_stock(build):
    stock = build()
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    assert fused.lorafuse_report.n_patched == fused.lorafuse_report.n_lora > 0
    ids = _inputs(stock)
    ls, lf = _loss(stock, ids), _loss(fused, ids)
    assert_close(lf, ls, atol=ATOL, rtol=RTOL, name="loss")
    ls.backward()
    lf.backward()
    gs, gf = _grads(stock), _grads(fused)
    assert gs.keys() == gf.keys() and all("lora_" in n for n in gf)
    for n in gs:
        assert_close(gf[n], gs[n], atol=ATOL, rtol=RTOL, name=n)
    for n, p in fused.named_parameters():
        if "lora_" not in n:
            assert p.grad is None, f"frozen {n} got a gradient"


@pytest.mark.parametrize("build", [_llama_peft, _mlp_peft], ids=["llama", "mlp"])
def test_adamw_steps_match_stock(build):
    stock = build()
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        for m in (stock, fused)
    ]
    for step in range(5):
        ids = _inputs(stock, seed=step)
        losses = []
        for m, opt in zip((stock, fused), opts):
            opt.zero_grad()
            loss = _loss(m, ids)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        # Adam normalises each gradient element, so for elements whose gradient is a near-total
        # cancellation the ulp-level bracketing difference is amplified up to O(lr) per step;
        # lr=1e-3 (a realistic LoRA rate) keeps that inside atol=1e-5 over 5 steps.
        assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-4, name=f"loss step {step}")
    # Final adapters: compared by relative Frobenius norm, not per element. An element whose
    # first gradient is a near-total cancellation (measured: 3.3e-9 stock vs 2.9e-9 fused, at
    # 1e-6 of the tensor's max) gets an O(lr) Adam step either way, so per-element differences
    # reach ~2e-5 while the tensor as a whole agrees to ~1e-5 relative; a wrong formula is O(1).
    ws = dict(stock.named_parameters())
    for n, p in fused.named_parameters():
        if "lora_" in n:
            rel = ((p - ws[n]).norm() / ws[n].norm()).item()
            assert rel < 1e-4, f"{n}: relative difference {rel:.2e} after 5 AdamW steps"


@pytest.mark.parametrize("build", [_llama_peft, _mlp_peft], ids=["llama", "mlp"])
def test_dropout_same_seed_matches_stock(build):
    stock = build(dropout=0.3)
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    ids = _inputs(stock)
    out = {}
    for tag, m in (("stock", stock), ("fused", fused)):
        torch.manual_seed(42)
        loss = _loss(m, ids)
        loss.backward()
        out[tag] = (loss.detach(), _grads(m))
    assert_close(out["fused"][0], out["stock"][0], atol=ATOL, rtol=RTOL, name="loss with dropout")
    for n, g in out["stock"][1].items():
        assert_close(out["fused"][1][n], g, atol=ATOL, rtol=RTOL, name=n)


def test_eval_disables_dropout_and_train_restores_it():
    stock = _llama_peft(dropout=0.3)
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    ids = _tokens()
    stock.eval()
    fused.eval()
    a, b = fused(ids).logits, fused(ids).logits
    assert torch.equal(a, b), "eval() must make the fused forward deterministic"
    assert_close(a, stock(ids).logits, atol=ATOL, rtol=RTOL, name="eval logits")
    fused.train()
    torch.manual_seed(0)
    c = fused(ids).logits
    torch.manual_seed(1)
    assert not torch.equal(c, fused(ids).logits), "train() must re-enable dropout"


def test_disable_adapter_and_merge_keep_peft_semantics():
    stock = _llama_peft()
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    ids = _tokens()
    with torch.no_grad():
        with stock.disable_adapter():
            base_stock = stock(ids).logits
        with fused.disable_adapter():
            base_fused = fused(ids).logits
        adapted = fused(ids).logits
        fused.merge_adapter()
        merged = fused(ids).logits
        fused.unmerge_adapter()
        unmerged = fused(ids).logits
    assert torch.equal(base_fused, base_stock)
    assert not torch.allclose(adapted, base_fused), "adapter had no effect: test is vacuous"
    # merged weights round B·A·s into W once: fp32 rounding of the merged sum, ~1e-6 relative.
    assert_close(merged, adapted, atol=1e-4, rtol=1e-4, name="merged vs adapter path")
    assert_close(unmerged, adapted, atol=1e-5, rtol=1e-5, name="after unmerge")
    assert all(is_fused_lora(m) for m in fused.modules() if hasattr(m, "lora_A") and m.lora_A)


def test_save_pretrained_loads_in_stock_peft(tmp_path):
    from transformers import LlamaForCausalLM

    fused = patch_peft_model(_llama_peft(), backend="torch")
    fused.save_pretrained(tmp_path)
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config())
    loaded = peft.PeftModel.from_pretrained(base, tmp_path)
    ids = _tokens()
    with torch.no_grad():
        fused.eval()
        assert_close(loaded(ids).logits, fused(ids).logits, atol=ATOL, rtol=RTOL, name="reloaded")
    keys = set(fused.state_dict())
    assert keys == set(copy.deepcopy(loaded).state_dict()), "state_dict keys changed"


def test_report_lists_dora_and_several_adapters():
    model = _llama_peft()
    dora_cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    model.add_adapter("dora", dora_cfg)
    report = patch_peft_model(model, backend="torch").lorafuse_report
    assert isinstance(report, PatchReport)
    assert report.n_patched == 14 and report.n_lora == 14  # active adapter "default": all fused
    assert not any("DoRA" in n for n in report.notes)
    model.set_adapter("dora")
    report = patch_peft_model(model, backend="torch").lorafuse_report
    q = [n for n in report.patched if n.endswith("q_proj")]
    assert len(q) == 2 and report.n_patched == 2, "DoRA adapters take the fused DoRA op"
    assert any("fused DoRA on 2 module(s)" in n for n in report.notes), report.notes
    assert "patched 2 of 14 LoRA modules" in str(report) and "fused DoRA" in str(report)
    model.base_model.set_adapter(["default", "dora"])
    report = patch_peft_model(model, backend="torch").lorafuse_report
    assert any("several active adapters" in r for r in report.skipped.values())


def test_state_change_after_patch_warns_and_runs_peft():
    model = _llama_peft()
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["q_proj"]))
    patch_peft_model(model, backend="torch")
    ids = _tokens()
    model.base_model.set_adapter(["default", "second"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = model(ids).logits
    assert any("several active adapters" in str(w.message) for w in caught)
    unpatch_peft_model(model)
    with torch.no_grad():
        assert torch.equal(got, model(ids).logits)


def test_fan_in_fan_out_conv1d_is_reported():
    from transformers import GPT2Config, GPT2LMHeadModel

    base = GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    )
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    )
    report = patch_peft_model(model).lorafuse_report
    assert report.n_patched == 0 and "fan_in_fan_out" in next(iter(report.skipped.values()))


def test_unpatch_restores_and_patch_is_idempotent():
    stock = _llama_peft(dropout=0.2)
    model = copy.deepcopy(stock)
    patch_peft_model(model, backend="torch")
    first = str(model.lorafuse_report)
    patch_peft_model(model, backend="torch")
    assert str(model.lorafuse_report) == first
    unpatch_peft_model(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not hasattr(model, "lorafuse_report")
    ids = _tokens()
    torch.manual_seed(3)
    a = model(ids).logits
    torch.manual_seed(3)
    assert torch.equal(a, stock(ids).logits)


def test_trainable_base_bias_gets_gradient():
    stock = _mlp_peft(bias="all")
    fused = patch_peft_model(copy.deepcopy(stock), backend="torch")
    x = _inputs(stock)
    _loss(stock, x).backward()
    _loss(fused, x).backward()
    gs = _grads(stock)
    for n, g in _grads(fused).items():
        assert_close(g, gs[n], atol=ATOL, rtol=RTOL, name=n)
    assert any(n.endswith("base_layer.bias") for n in gs)


def test_not_a_lora_model_is_a_clear_error():
    with pytest.raises(ValueError, match="no PEFT LoRA layers"):
        patch_peft_model(nn.Linear(2, 2))


def test_nf4_quantized_base_matches_stock_peft():
    """A Linear4bit base (weight = NF4Weight object) takes the fused path and agrees with stock
    PEFT running the same quantized layer."""
    from transformers import LlamaForCausalLM

    from lorafuse.models.nf4 import quantize_model_

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config())
    quantize_model_(base.model, torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL7))
    _randomize_lora_B(model)
    fused = patch_peft_model(copy.deepcopy(model), backend="torch")
    assert fused.lorafuse_report.n_patched == 14, str(fused.lorafuse_report)
    ids = _tokens()
    ls, lf = _loss(model, ids), _loss(fused, ids)
    ls.backward()
    lf.backward()
    assert_close(lf, ls, atol=ATOL, rtol=RTOL, name="loss (NF4 base)")
    gs = _grads(model)
    for n, g in _grads(fused).items():
        assert_close(g, gs[n], atol=ATOL, rtol=RTOL, name=n)
