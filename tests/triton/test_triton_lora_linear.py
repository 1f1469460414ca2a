"""Triton fused LoRA linear against the torch reference (ops/lora_linear.py)."""

from __future__ import annotations

import pytest
import torch
from tritonlib import (
    DEVICE,
    assert_lowp_close,
    interpret_on_cpu,  # noqa: F401  (fixture)
    reference,
)

from lorafuse.ops.lora_linear import lora_linear
from lorafuse.triton import lora_linear as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]

# (N, d, k, r): odd sizes that leave partial tiles everywhere; r=70 runs the epilogue's r-loop twice
SHAPES = [(3, 37, 29, 1), (1, 129, 33, 8), (37, 45, 70, 16), (17, 33, 20, 70)]
ALL = (True, True, True, True)


def _inputs(N, d, k, r, base, adapter, bias, dropout, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(DEVICE)

    x = randn(N, d, dtype=base)
    weight = randn(k, d, dtype=base, std=d**-0.5)  # outputs O(1), so atol means something
    b = randn(k, dtype=base) if bias else None
    A = randn(r, d, dtype=adapter, std=d**-0.5)
    B = randn(k, r, dtype=adapter, std=r**-0.5)
    mask = (torch.rand(N, d, generator=gen) < 0.75).to(DEVICE) if dropout else None
    g = randn(N, k, dtype=base)
    return x, weight, b, A, B, mask, g


def _f32(*ts):
    return [None if t is None else t.float() for t in ts]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias,dropout", [(False, False), (True, True)])
def test_fp32_matches_reference(close, shape, bias, dropout):
    fwd, bwd = reference("lora_linear")
    x, W, b, A, B, mask, g = _inputs(*shape, torch.float32, torch.float32, bias, dropout)
    y, xa = tri.forward(x, W, b, A, B, 0.5, mask, 0.75)
    y0, xa0 = fwd(x, W, b, A, B, 0.5, mask, 0.75)
    # fp32: only the summation order differs (K <= 129 terms of O(1) size: error ~1e-6)
    close(y, y0, atol=2e-5, rtol=1e-5, name="y")
    close(xa, xa0, atol=2e-5, rtol=1e-5, name="xa")
    got = tri.backward(g, x, W, A, B, xa, 0.5, mask, 0.75, ALL)
    ref = bwd(g, x, W, A, B, xa0, 0.5, mask, 0.75, ALL)
    for name, a, e in zip(("dx", "dA", "dB", "db"), got, ref):
        close(a, e, atol=5e-5, rtol=1e-5, name=name)  # dA/dB sum over N <= 37 more terms


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize(
    "base,adapter",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_low_precision_against_fp32_oracle(close, shape, base, adapter):
    fwd, bwd = reference("lora_linear")
    x, W, b, A, B, mask, g = _inputs(*shape, base, adapter, bias=True, dropout=True)
    y, xa = tri.forward(x, W, b, A, B, 1.5, mask, 0.75)
    assert y.dtype == base and xa.dtype == adapter
    # The oracle: the same rounded inputs, every step in fp32.
    x32, W32, b32, A32, B32, g32 = _f32(x, W, b, A, B, g)
    y0, xa0 = fwd(x32, W32, b32, A32, B32, 1.5, mask, 0.75)
    # y: fp32 accumulation, one rounding to the output dtype, plus xa's rounding to the adapter
    # dtype feeding the rank-r term, and the scaling folded into it (1.5: not exact in bf16):
    # 3 half-ulps; 3 ulps leaves room for fp16/bf16 alike.
    assert_lowp_close(close, y, y0, ulps=3, name="y")
    assert_lowp_close(close, xa, xa0, ulps=1, name="xa")
    got = tri.backward(g, x, W, A, B, xa, 1.5, mask, 0.75, ALL)
    ref = bwd(g32, x32, W32, A32, B32, xa0, 1.5, mask, 0.75, ALL)
    # Gradients see up to three roundings (gB or xa to the adapter dtype, the GEMM's output, the
    # dropout multiply of the rounded input): 4 ulps.
    for name, a, e in zip(("dx", "dA", "dB", "db"), got, ref):
        assert_lowp_close(close, a, e, ulps=4, name=name)


@pytest.mark.parametrize(
    "needs",
    [(True, False, False, False), (False, True, False, False), (False, False, True, True)],
)
def test_only_requested_gradients(close, needs):
    _, bwd = reference("lora_linear")
    x, W, b, A, B, mask, g = _inputs(5, 24, 18, 4, torch.float32, torch.float32, True, True)
    y, xa = tri.forward(x, W, b, A, B, 1.0, mask, 0.75)
    got = tri.backward(g, x, W, A, B, xa, 1.0, mask, 0.75, needs)
    ref = bwd(g, x, W, A, B, xa, 1.0, mask, 0.75, needs)
    for name, want, a, e in zip(("dx", "dA", "dB", "db"), needs, got, ref):
        assert (a is None) == (not want), f"{name}: asked {want}, got {type(a)}"
        if want:
            close(a, e, atol=5e-5, rtol=1e-5, name=name)


def test_autograd_through_op_with_dropout(close):
    """The op entry point with backend='triton' equals backend='torch' (same seed, same mask)."""
    x, W, b, A, B, _, _ = _inputs(2 * 7, 40, 24, 8, torch.float32, torch.float32, True, False)
    x3 = x.reshape(2, 7, 40)
    outs = {}
    for backend in ("torch", "triton"):
        xi = x3.clone().requires_grad_(True)
        Ai = A.clone().requires_grad_(True)
        Bi = B.clone().requires_grad_(True)
        torch.manual_seed(123)
        if DEVICE.type == "cuda":
            torch.cuda.manual_seed(123)
        y = lora_linear(
            xi, W, b, Ai, Bi, scaling=1.5, dropout_p=0.3, training=True, backend=backend
        )
        (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).reshape(y.shape)).sum().backward()
        outs[backend] = (y, xi.grad, Ai.grad, Bi.grad)
    for name, a, e in zip(("y", "dx", "dA", "dB"), outs["triton"], outs["torch"]):
        close(a, e, atol=5e-5, rtol=1e-5, name=name)


def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    from lorafuse.triton._common import check_device

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        check_device("lora_linear", torch.zeros(1))
