"""Mixture-of-experts models through FastLanguageModel.get_peft_model: by default LoRA reaches the
routed experts (PEFT target_parameters on the fused 3-D tensors), the routers and the shared
experts; the experts run the fused op (lorafuse.ops.moe_lora) and equal stock PEFT (same LoRA
weights) in the loss with the router aux loss, the logits and every LoRA gradient; the saved
adapter holds LoRA tensors only and loads in stock PEFT with the same logits."""

from __future__ import annotations

import copy
import types

import peft
import pytest
import torch
from safetensors.torch import load_file

from lorafuse import FastLanguageModel
from lorafuse.errors import SettingError
from lorafuse.patching import moe
from lorafuse.testing import assert_close
from lorafuse.testing.new_families import FAMILY_CASES, build_family_model
from lorafuse.testing.numerics import (
    assert_as_accurate_as_stock,
    assert_fp32_as_accurate_as_stock,
    fp32_oracle,
    fp64_oracle,
    rms_error,
)

# the "moe" cases and the hybrids that carry experts too
MOE = sorted([a for a, case in FAMILY_CASES.items() if case[2] == "moe"]
             + ["Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM"])  # fmt: skip
# Qwen3-Next, watched (issues 49, 50): against the fp64 oracle ours is as close as stock in file
# runs (logits 1.14e-5 vs stock's 1.31e-5, gradients 8.2e-5 vs 8.8e-5 rss), but earlier full-suite
# runs of one commit saw ours 3.8e-5 from stock's logits and not in others (rounding order; the C++
# RMSNorm's sum order, branch `drift`). Not strict until full-suite runs agree.
QWEN3_NEXT_DRIFT = pytest.mark.xfail(
    strict=False, reason="Qwen3-Next: fp32 drift from stock, issue 50"
)


def _known(archs, marked, mark):
    return [pytest.param(a, marks=mark) if a in marked else a for a in archs]


OPTS = dict(r=4, lora_alpha=8, init_lora_weights=False, use_gradient_checkpointing=False,
            cpu_heap_policy=False)  # fmt: skip


def _pair(arch, **kw):
    """(ours, stock): the same base and the same LoRA weights, ours patched, stock plain PEFT."""
    base = build_family_model(arch)
    stock_base = copy.deepcopy(base)
    ours = FastLanguageModel.get_peft_model(base, **OPTS, **kw)
    cfg = ours.peft_config["default"]
    params = list(cfg.target_parameters or [])
    stock = peft.get_peft_model(stock_base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=list(cfg.target_modules), target_parameters=params or None,
        init_lora_weights=False))  # fmt: skip
    stock.load_state_dict(ours.state_dict(), strict=True)
    return ours, stock


def _step(model, ids):
    model.train()
    kw = {"output_router_logits": True} if hasattr(model.config, "output_router_logits") else {}
    with torch.no_grad():  # the fused loss (Qwen3-MoE, gpt-oss) returns no logits with labels
        logits = model(input_ids=ids, **kw).logits
    out = model(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return types.SimpleNamespace(logits=logits, loss=out.loss,
                                 aux_loss=getattr(out, "aux_loss", None)), grads  # fmt: skip


def _ids(n=24):
    return torch.randint(3, 256, (2, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", _known(MOE, {"Qwen3NextForCausalLM"}, QWEN3_NEXT_DRIFT))
def test_moe_family_equals_stock_peft(arch):
    ours, stock = _pair(arch)
    n_experts = sum(moe.is_experts(m) for m in ours.modules())
    report = ours.lorafuse_report
    assert report.fast_paths[moe.FAST_PATH] == n_experts
    assert f"{2 * n_experts} of {2 * n_experts} routed expert tensors" in "\n".join(report.notes)
    oracle = fp64_oracle(stock)
    (o, og), (s, sg), (r, rg) = (_step(m, _ids()) for m in (ours, stock, oracle))
    if getattr(s, "aux_loss", None) is not None:  # the router's load-balancing loss is in .loss
        assert_close(o.aux_loss, s.aux_loss, atol=1e-6, rtol=1e-6, name="aux_loss")
    assert_close(o.loss, s.loss, atol=1e-5, rtol=1e-5, name="loss")
    assert og.keys() == sg.keys() == rg.keys()
    experts = [n for n in og if ".experts." in n]
    assert len(experts) == 4 * n_experts  # lora_A and lora_B of gate_up and down, every layer
    # Against the fp64 run, not stock's fp32 one: through the hybrids' decays stock itself is up
    # to 4e-5 from fp64 (Qwen3.5-MoE's gate and shared-expert-gate lora_B; ours 1.6e-5 there).
    assert_fp32_as_accurate_as_stock(o.logits, s.logits, r.logits, name="logits")
    assert_fp32_as_accurate_as_stock(og, sg, rg, name="LoRA gradients")


@pytest.mark.parametrize(
    "arch", _known(["GptOssForCausalLM", "Qwen3NextForCausalLM"], {"Qwen3NextForCausalLM"},
                   QWEN3_NEXT_DRIFT))  # fmt: skip
def test_saved_adapter_is_lora_only_and_loads_in_stock_peft(arch, tmp_path):
    ours, _ = _pair(arch)
    ours.eval()
    with torch.no_grad():
        logits = ours(input_ids=_ids()).logits
    ours.save_pretrained(tmp_path)
    keys = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), sorted(keys)[:4]
    assert any(".experts." in k for k in keys)
    loaded = peft.PeftModel.from_pretrained(build_family_model(arch), tmp_path).eval()
    oracle = fp64_oracle(loaded)
    with torch.no_grad():  # stock's logits and ours, each against the fp64 run (issue 49's rule)
        expected = [m(input_ids=_ids()).logits for m in (loaded, oracle)]
    assert_fp32_as_accurate_as_stock(logits, *expected, name="logits")


def test_expert_lora_off_leaves_experts_frozen_and_says_so():
    ours, _ = _pair("GptOssForCausalLM", expert_lora=False)
    assert not ours.peft_config["default"].target_parameters
    notes = "\n".join(ours.lorafuse_report.notes)
    assert "0 of 4 routed expert tensors" in notes
    assert "untrained: mlp.experts.gate_up_proj (expert_lora=False)" in notes
    assert ours.lorafuse_report.fast_paths[moe.FAST_PATH] == 2  # frozen experts still fused
    _, grads = _step(ours, _ids())
    assert not any(".experts." in n or ".router." in n for n in grads)


def test_expert_lora_with_dropout_is_one_clear_error():
    with pytest.raises(SettingError, match="lora_dropout=0.1.*--no-expert-lora"):
        FastLanguageModel.get_peft_model(build_family_model("Qwen3MoeForCausalLM"),
                                         **{**OPTS, "lora_dropout": 0.1})  # fmt: skip


def _replay_routing(models, monkeypatch) -> dict:
    """Every router of ``models[1:]`` picks the experts that the same router of ``models[0]``
    picked in its last forward (its own weights for them: the values at those indices); returns
    ``{router: the indices}``.

    A router's top-k is a discrete choice. Where two experts' router logits lie closer than the
    bf16 rounding of the hidden states, either may win, for stock and ours alike, and the token's
    whole contribution moves to another expert: that measures the tie, not accuracy. Qwen3-MoE,
    native bf16, ids seed 0: token 6 of layer 1 (router logits 0.008 apart) went to the other
    expert in our run and not in stock's, and our adapter gradients were 2.25x stock's distance
    from the oracle; seed 8 the other way round (0.62x). Over seeds 0-11, ours / stock is
    0.62-2.25 (median 0.95) without the replay, 0.84-1.07 with it."""
    chosen, current, topk = {}, [], torch.topk

    def routed_topk(x, k, dim=-1, *args, **kwargs):
        if not current:  # not inside a router (the load-balancing loss has its own top-k)
            return topk(x, k, dim, *args, **kwargs)
        name, replay = current[-1]
        if not replay:
            out = topk(x, k, dim, *args, **kwargs)
            chosen[name] = out.indices
            return out
        return x.gather(dim, chosen[name]), chosen[name]

    monkeypatch.setattr(torch, "topk", routed_topk)
    for i, model in enumerate(models):
        for name, module in model.named_modules():
            if moe.is_router(module):
                key = (name.replace(".base_layer", ""), i > 0)
                module.register_forward_pre_hook(lambda *_, key=key: current.append(key))
                module.register_forward_hook(lambda *_: current.pop() and None)
    return chosen


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
def test_moe_family_bf16_as_accurate_as_stock(arch, cpu_low_precision, monkeypatch):
    """bf16 weights: ours and stock PEFT each against the fp32 model on the same rounded weights
    (logits and every LoRA gradient), ours no further than stock (lorafuse.testing.numerics),
    every router choosing the fp32 model's experts (:func:`_replay_routing`)."""
    ours, stock = _pair(arch)
    oracle = fp32_oracle(stock)
    ours, stock = ours.to(torch.bfloat16), stock.to(torch.bfloat16)
    for m in (ours, stock, oracle):  # PEFT keeps adapters in fp32 on a bf16 base
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
    routes = _replay_routing([oracle, ours, stock], monkeypatch)
    (r, rg), (o, og), (s, sg) = [_step(m, _ids()) for m in (oracle, ours, stock)]
    assert len(routes) == oracle.config.num_hidden_layers  # every router replayed
    assert_as_accurate_as_stock(o.logits, s.logits, r.logits, name="logits")

    # The fp32 adapter gradients of a bf16 model, by the same rule over all of them: each
    # tensor's rms error relative to its own scale, averaged. Per tensor the rule is noise: a
    # router's lora_B holds 16 numbers, and ours and stock round at different points.
    def rel(grads):
        return sum(rms_error(grads[n], rg[n]) / float(rg[n].pow(2).mean().sqrt()) for n in rg)

    assert rel(og) <= 1.5 * rel(sg), f"ours {rel(og) / len(rg):.3e}, stock {rel(sg) / len(rg):.3e}"


def test_loaded_moe_model_runs_fused_experts_with_stock_logits(tmp_path, monkeypatch):
    """FastLanguageModel.from_pretrained: no PEFT, the experts on the fused op (chat, infer,
    serve and their decoding steps: one call per MoE layer per step, although the loaded
    parameters still require grad), the logits of transformers' own loop."""
    from transformers import AutoModelForCausalLM

    from lorafuse.patching.peft_lora import is_installed
    from lorafuse.testing import chat_tokenizer
    from lorafuse.testing.new_families import save_family_model

    fused = moe.moe_lora
    save_family_model("Qwen3MoeForCausalLM", tmp_path, chat_tokenizer())
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path), dtype="float32")
    experts = [m for m in model.modules() if moe.is_experts(m)]
    assert experts and all(is_installed(m) for m in experts)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    calls = []
    monkeypatch.setattr(moe, "moe_lora", lambda x, *a: calls.append(x.shape) or fused(x, *a))
    ids = _ids(9)[:, :9] % 60 + 3
    with torch.no_grad():
        for n in (9, 1):  # prefill, then one token
            assert_close(model(input_ids=ids[:, :n]).logits, stock(input_ids=ids[:, :n]).logits,
                         atol=1e-5, rtol=1e-5, name=f"{n} tokens")  # fmt: skip
    assert len(calls) == 2 * len(experts), calls  # every layer, both steps, on the fused op


def test_chat_serve_load_runs_expert_lora_on_the_fused_op(tmp_path):
    """resolve.load_resolved (chat, infer, serve, eval): the adapter's experts run the fused op in
    every step, with stock PEFT's logits."""
    from lorafuse.models.resolve import ModelSpec, load_resolved
    from lorafuse.patching.peft_lora import is_installed
    from lorafuse.testing import chat_tokenizer
    from lorafuse.testing.new_families import save_family_model

    save_family_model("GptOssForCausalLM", tmp_path / "base", chat_tokenizer())
    ours, _ = _pair("GptOssForCausalLM")
    ours.save_pretrained(tmp_path / "adapter")
    model, _, _ = load_resolved(ModelSpec(str(tmp_path / "base"), {"a": str(tmp_path / "adapter")}),
                          dtype=torch.float32)  # fmt: skip
    outer = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert outer and all(is_installed(m) for m in outer)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    stock = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = _ids(9) % 60 + 3
    with torch.no_grad():
        assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits, atol=1e-5,
                     rtol=1e-5, name="logits")  # fmt: skip
