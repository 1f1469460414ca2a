"""The lean decoding step (patching/decode_step.py): the same logits and tokens as the model's own
forward on every registry architecture, and the model's own forward wherever the step is not the
plain one (masks, gradients, hooks, output flags, sliding windows in reach)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lorafuse import backends
from lorafuse.patching import decode_step, decoding
from lorafuse.patching.peft_lora import restore_forward

pytestmark = pytest.mark.cpp


@pytest.fixture(autouse=True)
def _needs_cpp():
    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")


def _tiny(arch: str, **extra):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
    cfg = getattr(transformers, f"{arch}Config")(**common, **extra)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to(torch.bfloat16).eval()
    for name, p in model.named_parameters():  # biases and norm weights away from 0 and 1
        if name.endswith("bias") or "norm" in name:
            nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    return model


def _twins(arch: str, **extra):
    """The model routed with the step, and the same weights routed without it (layers only)."""
    ours, theirs = _tiny(arch, **extra), _tiny(arch, **extra)
    decoding.install(ours)
    decoding.install(theirs)
    assert restore_forward(theirs.model)
    return ours, theirs


def _generate(model, ids, n=6, **kw):
    kw = {"do_sample": False, **kw}  # greedy unless asked
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)


def _steps(model, ids, n=3):
    """Logits of n decoding steps after a prefill, each step fed the previous greedy token."""
    steps = []
    with torch.inference_mode():
        res = model(ids, use_cache=True)
        for _ in range(n):
            nxt = res.logits[:, -1:].argmax(-1)
            res = model(nxt, cache=res.past_key_values, use_cache=True)
            steps.append(res.logits)
    return torch.cat(steps, 1)


@pytest.mark.parametrize(
    "arch, extra",
    [("Llama", {}), ("Qwen2", {}), ("Qwen3", {}), ("Mistral", {"sliding_window": 64})],
)
def test_step_gives_the_model_forwards_logits_bit_for_bit(arch, extra, monkeypatch):
    """Qwen2 adds q/k/v biases, Qwen3 its per-head q/k norms, Mistral a (distant) sliding
    window; the step takes all of them, op for op as transformers does."""
    ours, theirs = _twins(arch, **extra)
    steps, kernels = [], []
    real, compiled = decode_step._attention, backends.compiled
    monkeypatch.setattr(decode_step, "_attention", lambda *a: steps.append(1) or real(*a))
    monkeypatch.setattr(backends, "compiled", lambda *a: kernels.append(a[2:]) or compiled(*a))
    ids = torch.randint(0, 256, (2, 7))
    assert torch.equal(_steps(ours, ids), _steps(theirs, ids))
    assert len(steps) == 3 * 2  # three decoding steps of two layers took the lean step
    assert kernels.count(("stepwise",)) == 3 * 2  # RoPE through the C++ kernel
    assert torch.equal(_generate(ours, ids[:1]), _generate(theirs, ids[:1]))


def test_adapters_keep_their_effect_through_the_step():
    """PEFT's LoRA layers run their own forward inside the step: the adapter changes the tokens'
    logits exactly as it does through the model's own forward."""
    from peft import LoraConfig, get_peft_model

    models = []
    for _ in range(2):
        torch.manual_seed(1)
        peft = get_peft_model(_tiny("Llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.5)
        decoding.install(peft)
        models.append(peft.eval())
    assert restore_forward(models[1].base_model.model.model)
    ids = torch.randint(0, 256, (1, 5))
    assert torch.equal(_steps(models[0], ids), _steps(models[1], ids))
    with models[0].disable_adapter():
        assert not torch.equal(_steps(models[0], ids), _steps(models[1], ids))


def test_masks_windows_and_output_flags_take_the_model_forward(monkeypatch):
    steps = []
    real = decode_step._attention
    monkeypatch.setattr(decode_step, "_attention", lambda *a: steps.append(1) or real(*a))
    ours, theirs = _twins("Mistral", sliding_window=8)
    ids = torch.randint(0, 256, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: a mask tensor reaches the model
    tokens = _generate(ours, ids, n=8, attention_mask=mask)
    assert torch.equal(tokens, _generate(theirs, ids, n=8, attention_mask=mask))
    assert not steps
    _generate(ours, ids[:1], n=6)  # 6 + 6 tokens: the window of 8 comes within reach
    assert 0 < len(steps) < 5 * 2
    steps.clear()
    with torch.inference_mode():
        cache = ours(ids, use_cache=True).past_key_values
        ours(ids[:, :1], cache=cache, use_cache=True, output_attentions=True)
    with torch.no_grad(), torch.enable_grad():
        cache = ours(ids, use_cache=True).past_key_values
        ours(ids[:, :1], cache=cache, use_cache=True)
    assert not steps


def test_models_with_hooks_keep_their_forward_and_uninstall_restores_it():
    model = _tiny("Llama")
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    decoding.install(model)
    assert "forward" not in model.model.__dict__  # the step would skip the hook
    plain = _tiny("Llama")
    decoding.install(plain)
    assert "forward" in plain.model.__dict__
    assert decoding.uninstall(plain) == 15 + 5 + 1
    assert "forward" not in plain.model.__dict__


def test_a_static_cache_takes_the_model_forward(monkeypatch):
    """A static cache's empty slots need the model's mask: the step leaves it alone, and the
    logits are the model's own."""
    from transformers import StaticCache

    steps = []
    real = decode_step._attention
    monkeypatch.setattr(decode_step, "_attention", lambda *a: steps.append(1) or real(*a))
    ours, theirs = _twins("Llama")
    ids = torch.randint(0, 256, (1, 5))
    logits = []
    for model in (ours, theirs):
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.inference_mode():
            first = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            logits.append(model(first, cache=cache, use_cache=True).logits)
    assert torch.equal(*logits)
    assert not steps
    _generate(ours, ids)  # the default dynamic cache: the step runs
    assert steps


@pytest.mark.parametrize(
    "kw",
    [
        {"num_beams": 3},
        {"do_sample": True, "top_k": 5},
        {"num_beams": 2, "num_return_sequences": 2},
    ],
)
def test_beam_search_and_sampling_match_the_model_forward(kw, monkeypatch):
    """Beams reorder the cache between steps and sampling draws from the logits: both give the
    model's own tokens (same seed) with the step taking every decoding step."""
    steps = []
    real = decode_step._attention
    monkeypatch.setattr(decode_step, "_attention", lambda *a: steps.append(1) or real(*a))
    ours, theirs = _twins("Llama")
    ids = torch.randint(0, 256, (1, 6))
    torch.manual_seed(5)
    tokens = _generate(ours, ids, **kw)
    torch.manual_seed(5)
    assert torch.equal(tokens, _generate(theirs, ids, **kw))
    assert len(steps) == (6 - 1) * 2  # every token after the first, two layers
