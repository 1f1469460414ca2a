"""Triton LoRA Conv2d parts against the torch reference (ops/lora_conv.py), kernels and op."""

from __future__ import annotations

import pytest
import torch
from tritonlib import (
    DEVICE,
    assert_lowp_close,
    interpret_on_cpu,  # noqa: F401  (fixture)
    reference,
)

from lorafuse.ops.lora_conv import lora_conv2d, lora_conv2d_reference

pytestmark = [
    pytest.mark.triton,
    pytest.mark.usefixtures("interpret_on_cpu", "ieee_fp32_convs"),  # tests/conftest.py
]


import lorafuse.triton.lora_conv as tri  # noqa: E402  (tritonlib imported it interpreted on CPU)

ALL = (True, True, True, True)
# (N, Cin, Cout, k, stride, padding, (H, W), r): partial tiles everywhere; r=70 runs the
# forward kernel's rank loop twice (BLOCK_R 64) and the backward kernel's rank tile at 128.
SHAPES = [
    (2, 5, 7, 3, 1, 1, (6, 5), 1),
    (1, 9, 70, 1, 1, 0, (9, 9), 8),
    (2, 6, 10, 3, 2, 0, (9, 8), 70),
]


def _inputs(shape, base, adapter, bias, seed=0):
    n, cin, cout, k, stride, padding, (h, w), r = shape
    gen = torch.Generator().manual_seed(seed)

    def rn(*s, dtype, std=1.0):
        return (torch.randn(*s, generator=gen) * std).to(dtype).to(DEVICE)

    x = rn(n, cin, h, w, dtype=base)
    weight = rn(cout, cin, k, k, dtype=base, std=(cin * k * k) ** -0.5)
    b = rn(cout, dtype=base) if bias else None
    down = rn(r, cin, k, k, dtype=adapter, std=(cin * k * k) ** -0.5)
    up = rn(cout, r, 1, 1, dtype=adapter, std=r**-0.5)
    geometry = ((stride, stride), (padding, padding), (1, 1), 1)
    return x, weight, b, down, up, geometry


def _grad(y, seed=1):
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_reference(close, shape, bias):
    fwd, bwd = reference("lora_conv")
    x, W, b, down, up, geo = _inputs(shape, torch.float32, torch.float32, bias)
    y, t = tri.forward(x, W, b, down, up, 0.5, *geo)
    y0, t0 = fwd(x, W, b, down, up, 0.5, *geo)
    # fp32: only the summation order of the rank-r term differs (<= 70 terms of O(1))
    close(y, y0, atol=2e-5, rtol=1e-5, name="y")
    close(t, t0, atol=2e-5, rtol=1e-5, name="t")
    g = _grad(y)
    got = tri.backward(g, x, W, down, up, t, 0.5, *geo, ALL)
    want = bwd(g, x, W, down, up, t0, 0.5, *geo, ALL)
    for name, a, e in zip(("dx", "d_down", "d_up", "db"), got, want):
        assert (a is None) == (e is None), name
        if e is not None:  # d_down/d_up sum over N·H'·W' <= 162 more terms
            close(a, e, atol=5e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize(
    "base,adapter",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),  # CUDA autocast's default dtype
    ],
)
def test_low_precision_against_fp32_oracle(close, shape, base, adapter):
    fwd, _ = reference("lora_conv")
    x, W, b, down, up, geo = _inputs(shape, base, adapter, bias=True)
    y, t = tri.forward(x, W, b, down, up, 1.5, *geo)
    assert y.dtype == base and t.dtype == adapter
    f32 = [None if v is None else v.float() for v in (x, W, b, down, up)]
    y0, t0 = fwd(*f32, 1.5, *geo)
    # The oracle: the same rounded inputs, every step in fp32. y rounds the base conv's output
    # (torch's conv, in bf16), t (adapter dtype) and the in-place sum: 3 half-ulps; 3 ulps
    # (bf16 ulps: fp16's are 8x finer, so the bound holds for it too).
    assert_lowp_close(close, y, y0, ulps=3, name="y")
    g = _grad(y)
    gt = tri.up_t(g, up, 1.5, adapter)  # (N, r, H', W'): one rounding of an fp32 sum
    n, r = t.shape[:2]
    gt0 = torch.matmul(up.float().reshape(-1, r).t(), g.float().reshape(n, g.shape[1], -1))
    assert_lowp_close(close, gt, (gt0 * 1.5).view(t.shape), ulps=1, name="gt")


def test_channels_last_tensors_are_indexed_through_strides(close):
    fwd, _ = reference("lora_conv")
    x, W, b, down, up, geo = _inputs(SHAPES[0], torch.float32, torch.float32, bias=True)
    xcl = x.to(memory_format=torch.channels_last)
    y, t = tri.forward(xcl, W, b, down, up, 0.5, *geo)
    y0, _ = fwd(x, W, b, down, up, 0.5, *geo)
    close(y, y0, atol=2e-5, rtol=1e-5, name="y (channels last)")
    g = _grad(y).to(memory_format=torch.channels_last)
    gt = tri.up_t(g, up, 0.5, torch.float32)
    gt0 = torch.nn.functional.conv2d(g, up.reshape(up.shape[0], -1).t()[:, :, None, None]) * 0.5
    close(gt, gt0, atol=2e-5, rtol=1e-5, name="gt (channels last)")


def test_op_with_triton_backend_matches_reference(close):
    """The wiring: lora_conv2d(backend='triton') through autograd equals the autograd oracle."""
    x, W, b, down, up, _ = _inputs(SHAPES[2], torch.float32, torch.float32, bias=True)
    leaves = [v.requires_grad_(True) for v in (x, b, down, up)]
    y = lora_conv2d(x, W, b, down, up, 0.5, 2, 0, backend="triton")
    g = _grad(y)
    got = torch.autograd.grad(y, leaves, g)
    ry = lora_conv2d_reference(x, W, b, down, up, 0.5, 2, 0)
    want = torch.autograd.grad(ry, leaves, g)
    close(y, ry, atol=2e-5, rtol=1e-5, name="y")
    for name, a, e in zip(("dx", "db", "d_down", "d_up"), got, want):
        close(a, e, atol=5e-5, rtol=1e-5, name=name)
