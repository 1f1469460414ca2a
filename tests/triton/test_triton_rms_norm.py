"""Triton RMSNorm against the torch reference (ops/rms_norm.py)."""

from __future__ import annotations

import pytest
import torch
from tritonlib import (
    DEVICE,
    assert_lowp_close,
    interpret_on_cpu,  # noqa: F401  (fixture)
    reference,
)

from lorafuse.triton import rms_norm as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]

SHAPES = [(3, 37), (1, 129), (9, 64), (2, 1500)]  # 1500: not a power of two, > 1024 lanes


def _inputs(N, d, dtype, wdtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, d, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(wdtype).to(DEVICE)
    g = torch.randn(N, d, generator=gen).to(torch.promote_types(dtype, wdtype)).to(DEVICE)
    return x, w, g


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_reference(close, shape):
    fwd, bwd = reference("rms_norm")
    x, w, g = _inputs(*shape, torch.float32, torch.float32)
    y, rstd = tri.forward(x, w, 1e-6)
    y0, rstd0 = fwd(x, w, 1e-6)
    # fp32: the row reduction's order differs; d <= 1500 terms -> ~1e-6 relative
    close(rstd, rstd0, atol=1e-6, rtol=1e-5, name="rstd")
    close(y, y0, atol=1e-5, rtol=1e-5, name="y")
    dx, dw = tri.backward(g, x, w, rstd, (True, True))
    dx0, dw0 = bwd(g, x, w, rstd0, (True, True))
    close(dx, dx0, atol=1e-5, rtol=1e-5, name="dx")
    close(dw, dw0, atol=1e-5, rtol=1e-5, name="dw")


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_bf16_against_fp32_oracle(close, shape, wdtype):
    fwd, bwd = reference("rms_norm")
    x, w, g = _inputs(*shape, torch.bfloat16, wdtype)
    y, rstd = tri.forward(x, w, 1e-6)
    assert y.dtype == torch.promote_types(torch.bfloat16, wdtype) and rstd.dtype == torch.float32
    y_same, _ = fwd(x, w, 1e-6)  # the reference on the same bf16 tensors rounds where we do
    assert_lowp_close(close, y, y_same, ulps=1, name="y vs reference")
    y0, rstd0 = fwd(x.float(), w.float(), 1e-6)  # oracle: same values, no intermediate rounding
    close(rstd, rstd0, atol=0, rtol=1e-5, name="rstd")  # computed in fp32 from the same inputs
    # y: normed rounded to bf16, then the product rounded: 2 half-ulps
    assert_lowp_close(close, y, y0, ulps=2, name="y")
    dx, dw = tri.backward(g, x, w, rstd, (True, True))
    dx0, dw0 = bwd(g.float(), x.float(), w.float(), rstd0, (True, True))
    # dx: fp32 math, one rounding of the output (1 half-ulp); dw: the sum of g·bf16(normed)
    # (each term off by a half-ulp relative) then one rounding: 2 ulps covers both.
    assert_lowp_close(close, dx, dx0, ulps=2, name="dx")
    assert_lowp_close(close, dw, dw0, ulps=2, name="dw")
    assert dx.dtype == x.dtype and dw.dtype == w.dtype


@pytest.mark.parametrize("needs", [(True, False), (False, True), (False, False)])
def test_only_requested_gradients(close, needs):
    _, bwd = reference("rms_norm")
    x, w, g = _inputs(4, 40, torch.float32, torch.float32)
    _, rstd = tri.forward(x, w, 1e-5)
    got = tri.backward(g, x, w, rstd, needs)
    ref = bwd(g, x, w, rstd, needs)
    for name, want, a, e in zip(("dx", "dw"), needs, got, ref):
        assert (a is None) == (not want), f"{name}: asked {want}, got {type(a)}"
        if want:
            close(a, e, atol=1e-5, rtol=1e-5, name=name)
