"""Decoding's few-row product (ops/decode_linear.py, csrc/decode_linear.cpp): values, where it
applies, how models get it (patching/decoding.py), and its errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lorafuse import backends, hardware
from lorafuse.generation import _CACHE_KW
from lorafuse.ops import decode_linear
from lorafuse.patching import decoding
from lorafuse.testing import within_fp32_sum_bound

pytestmark = pytest.mark.cpp


@pytest.fixture(autouse=True)
def _needs_cpp():
    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("k", [1, 15, 64, 200, 1536])
def test_rows_are_the_fp32_sum_rounded_once(dtype, rows, k):
    """Each output is the fp32 sum rounded once (within the bound against float64). A wrong row,
    tile, column or bias is off by far more. 1000 outputs: several tiles and threads, and a
    ragged last block of four rows; k = 1 and 15 cover the vector tail alone."""
    torch.manual_seed(rows * 1000 + k)
    w = torch.randn(1000, k, dtype=dtype) / k**0.5
    b = torch.randn(1000, dtype=dtype)
    x = torch.randn(rows, k, dtype=dtype)
    y = decode_linear.decode_linear(x, w, b)
    assert y.dtype == dtype and y.shape == (rows, 1000)
    assert within_fp32_sum_bound(y, x, w, b)
    assert within_fp32_sum_bound(decode_linear.decode_linear(x, w, None), x, w, None)
    wrong = decode_linear.decode_linear(x, w.roll(1, 0), b)  # the bound catches a wrong row
    assert not within_fp32_sum_bound(wrong, x, w, b)


def test_leading_dimensions_are_kept():
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    x = torch.randn(2, 1, 32, dtype=torch.bfloat16)
    y = decode_linear.decode_linear(x, w, None)
    assert y.shape == (2, 1, 48)
    assert torch.allclose(y.float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-6)


def test_applies_only_where_the_kernel_fits():
    bf = torch.bfloat16
    w = torch.zeros(16, 32, dtype=bf)
    x = torch.zeros(1, 1, 32, dtype=bf)
    limit = decode_linear.row_limit(bf)
    assert limit == (3 if hardware.native_low_precision_matmul("cpu", bf) else 8)
    with torch.no_grad():
        assert decode_linear.applies(x, w, None)
        assert decode_linear.applies(torch.zeros(limit, 32, dtype=bf), w, torch.zeros(16, dtype=bf))
        assert not decode_linear.applies(torch.zeros(limit + 1, 32, dtype=bf), w, None)  # prefill
        assert not decode_linear.applies(x.float(), w.float(), None)  # fp32: MKL's sgemv is fine
        assert not decode_linear.applies(x, w.float(), None)  # mixed dtypes
        assert not decode_linear.applies(x, w, torch.zeros(16))  # fp32 bias
        assert not decode_linear.applies(x, w.t().contiguous().t(), None)  # strided weight
    p = nn.Parameter(w.clone())  # a weight with a gradient to carry (full fine-tuning)
    assert not decode_linear.applies(x, p, None)
    assert not decode_linear.applies(x.clone().requires_grad_(), w, None)
    with torch.no_grad():
        assert decode_linear.applies(x, p, None)  # no autograd: no gradient to carry
    previous, decode_linear.MAX_ROWS = decode_linear.MAX_ROWS, 0
    try:
        assert not decode_linear.applies(x, w, None)
    finally:
        decode_linear.MAX_ROWS = previous


def test_kernel_errors_name_the_problem():
    (kernel,) = backends.compiled("decode_linear", "cpp", "forward")
    bf = torch.bfloat16
    w = torch.zeros(16, 32, dtype=bf)
    with pytest.raises(RuntimeError, match=r"takes 1 to 8 rows, got 9"):
        kernel(torch.zeros(9, 32, dtype=bf), w, None)
    with pytest.raises(RuntimeError, match=r"x must be a contiguous CPU \(\.\.\., 32\) tensor"):
        kernel(torch.zeros(1, 31, dtype=bf), w, None)
    with pytest.raises(RuntimeError, match=r"x must be a contiguous CPU \(\.\.\., 32\) tensor"):
        kernel(torch.zeros(32, 2, dtype=bf).t(), w, None)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 or float16"):
        kernel(torch.zeros(1, 32), w.float(), None)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous CPU BFloat16"):
        kernel(torch.zeros(1, 32, dtype=bf), w.half(), None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \(16,\)"):
        kernel(torch.zeros(1, 32, dtype=bf), w, torch.zeros(15, dtype=bf))


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(cfg).to(dtype).eval()


def test_installed_model_decodes_through_the_kernel_with_the_same_logits(monkeypatch):
    """install() routes every plain nn.Linear (7 per layer and the head); a decoding step runs the
    kernel on each, prefill does not, and the step's logits match torch's within bf16 rounding."""
    model = _tiny_llama(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 12))

    def last_step():  # prefill 11 tokens, then decode the 12th over the cache
        with torch.inference_mode():
            cache = model(ids[:, :-1], use_cache=True).past_key_values
            return model(ids[:, -1:], **{_CACHE_KW: cache}).logits.float()

    ref = last_step()
    assert decoding.install(model) == 15
    assert decoding.install(model) == 0  # idempotent
    calls = []
    real = decode_linear.decode_linear
    monkeypatch.setattr(decode_linear, "decode_linear", lambda *a: calls.append(1) or real(*a))
    step = last_step()
    assert len(calls) == 15  # the decoding step's; prefill's 22 rows take torch's product
    assert torch.allclose(step, ref, rtol=0.05, atol=0.05)  # bf16 activations through 2 layers


def test_peft_adapters_and_training_keep_working():
    """PEFT wraps the routed base layers: an adapter still changes the decoding output (its
    lora.Linear calls the base layer, then adds its own product), and a training step (rows > 8,
    gradients) takes torch's path with gradients flowing to the adapter."""
    from peft import LoraConfig, get_peft_model

    model = _tiny_llama(torch.bfloat16)
    decoding.install(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)
    ids = torch.randint(0, 256, (1, 6))
    with torch.inference_mode():
        with_adapter = peft_model(ids[:, :1]).logits
        with peft_model.disable_adapter():
            without = peft_model(ids[:, :1]).logits
    assert not torch.equal(with_adapter, without)
    peft_model.train()
    loss = peft_model(torch.randint(0, 256, (2, 16)), labels=torch.randint(0, 256, (2, 16))).loss
    loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_torch_compile_traces_f_linear_without_breaks():
    """Under torch.compile a routed layer is traced as F.linear (the kernel is no custom op)."""
    layers = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).bfloat16()
    decoding.install(layers)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert decode_linear.applies(x, layers[0].weight, layers[0].bias)  # eager: the kernel
        explained = torch._dynamo.explain(layers)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
