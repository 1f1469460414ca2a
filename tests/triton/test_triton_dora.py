"""Triton steps of the fused DoRA linear (triton/dora.py) against the torch ones (ops/dora.py,
ops/dora_passes.py), and the whole op with backend='triton' against backend='torch'."""

from __future__ import annotations

import pytest
import torch
from tritonlib import DEVICE, assert_lowp_close, interpret_on_cpu  # noqa: F401  (fixture)

from lorafuse.ops import dora, dora_passes
from lorafuse.triton import dora as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]

# (N, d, k, r): partial tiles everywhere; r = 20 pads the rank block to 32
SHAPES = [(3, 37, 29, 1), (17, 129, 70, 20)]


def _randn(gen, *shape, dtype=torch.float32, std=1.0):
    return (torch.randn(*shape, generator=gen) * std).to(dtype).to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_norm_matches_torch(close, shape, dtype):
    _, d, k, r = shape
    gen = torch.Generator().manual_seed(0)
    W = _randn(gen, k, d, dtype=dtype, std=d**-0.5)
    A, B = _randn(gen, r, d, std=d**-0.5), _randn(gen, k, r)
    got = tri.weight_norm(W, A, B, 0.7, torch.float32)
    want = dora._torch_weight_norm(W, A, B, 0.7, dtype)
    # both fp32 sums of <= 129 squares from the same (upcast) inputs, in another order
    close(got, want, atol=0, rtol=2e-6, name="norm")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_elementwise_steps_match_torch(close, shape, dtype):
    N, _, k, _ = shape
    gen = torch.Generator().manual_seed(1)
    h, g = _randn(gen, N, k, dtype=dtype), _randn(gen, N, k, dtype=dtype)
    bias = _randn(gen, k, dtype=dtype)
    norm = _randn(gen, k).abs() + 0.5
    scale = _randn(gen, k).abs() / norm
    y, y0 = tri.scale_rows(h, scale, bias), dora_passes.torch_scale_rows(h, scale, bias)
    # fp32 math from the same inputs, one rounding to the output dtype each: equal up to that
    close(y, y0, atol=0, rtol=1e-6 if dtype == torch.float32 else 2**-8, name="y")
    (gm, dm), (gm0, dm0) = (
        tri.grads(g, h, scale, True),
        dora_passes.torch_grads(g, h, scale, True),
    )
    close(gm, gm0, atol=0, rtol=1e-6 if dtype == torch.float32 else 2**-8, name="gm")
    close(dm, dm0, atol=1e-5 * dm0.abs().max().item(), rtol=1e-5, name="dm")  # N-term fp32 sums
    gm1, dm1 = tri.grads(g, h, scale, False)
    assert dm1 is None and torch.equal(gm1, gm)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_op_triton_equals_torch(close, p, dtype):
    N, d, k, r = 14, 40, 24, 8
    gen = torch.Generator().manual_seed(2)
    W = _randn(gen, k, d, dtype=dtype, std=d**-0.5)
    b = _randn(gen, k, dtype=dtype)
    base = [_randn(gen, 2, N // 2, d, dtype=dtype), _randn(gen, r, d, dtype=dtype, std=d**-0.5),
            _randn(gen, k, r, dtype=dtype), _randn(gen, k, dtype=dtype).abs() + 0.5]  # fmt: skip
    g = _randn(gen, 2, N // 2, k, dtype=dtype)
    outs = {}
    for backend in ("torch", "triton"):
        leaves = [t.clone().requires_grad_(True) for t in base]
        torch.manual_seed(123)
        if DEVICE.type == "cuda":
            torch.cuda.manual_seed(123)
        x, A, B, m = leaves
        y = dora.dora_linear(x, W, b, A, B, m, 1.5, p, backend=backend)
        outs[backend] = (y, *torch.autograd.grad(y, leaves, g))
    names = ("y", "dx", "dA", "dB", "dm")
    for name, a, e in zip(names, outs["triton"], outs["torch"]):
        if dtype == torch.float32:
            close(a, e, atol=5e-5 * e.abs().max().item(), rtol=1e-5, name=name)
        else:  # each backend rounds its products to bf16 once: 4 ulps as lora_linear's gradients
            assert_lowp_close(close, a, e, ulps=4, name=name)
