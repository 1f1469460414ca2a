"""int8 frozen products (ops/int8_linear.py, csrc/int8_linear.cpp): the C++ kernel against the
torch reference (exact integer products, so equal up to the epilogue's last rounding), the packed
layout round trip, the quantization error's bound, and a LoRA model on an int8 base through the
fused ops against stock PEFT's forward on the same int8 layers."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops import int8_linear as ops
from lorafuse.testing import assert_close

SHAPES = [(1, 5, 7), (3, 37, 129), (17, 576, 192), (40, 96, 64), (5, 1536, 65)]  # (N, in, out)


def needs_int8(test):
    """The C++ int8 kernel runs only where oneDNN's int8 micro-kernel does (AMX / AVX-512-VNNI)."""
    return pytest.mark.cpp(pytest.mark.skipif(not ops.available(), reason="no int8 kernel")(test))


def test_reference_quantization_bounds():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(9, 33, generator=g) * torch.logspace(-3, 2, 9)[:, None]
    v[4] = 0.0  # an all-zero row: scale 0, codes 0
    q, s = ops.quantize_rows(v)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and not q[4].any()
    err = (q.float() * s[:, None] - v).abs()
    assert bool((err <= s[:, None] / 2 * (1 + 1e-6)).all())  # round to nearest
    assert torch.equal(
        q.abs().amax(1)[[0, 1, 2, 3, 5, 6, 7, 8]], torch.full((8,), 127, dtype=torch.int8)
    )


def test_reference_product_error_is_small():
    """What int8 costs: the product of 8-bit rows against fp32's, on Gaussian data."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 576, generator=g), torch.randn(1536, 576, generator=g) * 0.02
    wq, sw = ops.quantize_weight(w)
    y = ops.forward_reference(x, wq, sw)
    exact = x @ w.t()
    rel = float((y - exact).norm() / exact.norm())
    assert rel < 0.02, rel


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpp_matches_reference(shape, dtype):
    n, d, k = shape
    g = torch.Generator().manual_seed(n * 7 + d)
    w = (torch.randn(k, d, generator=g) * 0.05).to(dtype)
    x, gy = torch.randn(n, d, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(k, generator=g).to(dtype)
    packed = ops.pack(w, backend="cpp")
    wq, sw = ops.quantize_weight(w)
    assert torch.equal(packed["sw"], sw) and torch.equal(ops.unpack(packed, w.shape), wq)
    # exact integer products: only the fp32 epilogue may round differently (a fused multiply-add),
    # by an fp32 ulp, which bf16's rounding can turn into one bf16 ulp (2^-8 relative)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    y = ops.linear(x, packed, w.shape, bias)
    assert y.dtype == dtype
    assert_close(y, ops.forward_reference(x, wq, sw, bias), name="y", **tol)
    dx = ops.input_grad(gy, packed, w.shape)
    assert_close(dx, ops.input_grad_reference(gy, wq, sw), name="dx", **tol)
    into = torch.randn(n, d, generator=g).to(dtype)
    want = ops.input_grad_reference(gy, wq, sw, into.clone())
    assert_close(ops.input_grad(gy, packed, w.shape, into=into), want, name="dx+", **tol)
    assert_close(into, want, name="into (in place)", **tol)


@needs_int8
def test_no_rows():
    w = torch.randn(64, 32)
    packed = ops.pack(w, backend="cpp")
    assert ops.linear(torch.empty(0, 32), packed, w.shape).shape == (0, 64)
    assert ops.input_grad(torch.empty(0, 64), packed, w.shape).shape == (0, 32)


def test_bad_input_names_the_problem():
    w = torch.randn(8, 4)
    packed = {"sw": ops.quantize_weight(w)[1], "wq": ops.quantize_weight(w)[0]}
    with pytest.raises(ValueError, match=r"x must be \(N, 4\)"):
        ops.linear(torch.randn(2, 5), packed, w.shape)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.linear(torch.randn(2, 4).half(), packed, w.shape)


@needs_int8
def test_lora_on_int8_base_matches_stock_peft():
    """The fused ops on an int8 base (its frozen products through the weight's own kernels)
    against stock PEFT running the same Linear8bit layers: same loss and LoRA gradients."""
    import peft
    from transformers import LlamaForCausalLM

    from lorafuse import patch_peft_model
    from lorafuse.models import int8
    from lorafuse.testing.llm import tiny_llama_config

    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_llama_config())
        int8.quantize_model_(model, torch.float32, skip=(model.lm_head,))
        cfg = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False
        )
        return peft.get_peft_model(model, cfg)

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    stock, fused = build(), patch_peft_model(build())
    assert "int8" in repr(fused.base_model.model.model.layers[0].mlp.down_proj.base_layer)
    losses, grads = [], []
    for model in (stock, fused):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert_close(losses[1], losses[0], name="loss", atol=1e-5, rtol=1e-5)
    for name, g in grads[0].items():
        assert_close(grads[1][name], g, name=name, atol=1e-5, rtol=1e-4)
