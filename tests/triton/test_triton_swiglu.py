"""Triton SwiGLU against the torch reference (ops/swiglu.py)."""

from __future__ import annotations

import pytest
import torch
from tritonlib import (
    DEVICE,
    assert_lowp_close,
    interpret_on_cpu,  # noqa: F401  (fixture)
    reference,
)

from lorafuse.triton import swiglu as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]

SHAPES = [
    (3, 37),
    (1, 129),
    (4, 1500),
]  # 1500·4 elements: several 1024-element blocks, a ragged end


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen) * 3).to(dtype).to(DEVICE) for _ in range(3)]


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_reference(close, shape):
    fwd, bwd = reference("swiglu")
    gate, up, g = _inputs(shape, torch.float32)
    # fp32 elementwise math; only exp/sigmoid implementations differ (a few ulps)
    close(tri.forward(gate, up), fwd(gate, up), atol=1e-6, rtol=1e-5, name="h")
    for name, a, e in zip(("dgate", "dup"), tri.backward(g, gate, up), bwd(g, gate, up)):
        close(a, e, atol=1e-6, rtol=1e-5, name=name)


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_against_fp32_oracle(close, shape):
    fwd, bwd = reference("swiglu")
    gate, up, g = _inputs(shape, torch.bfloat16)
    h = tri.forward(gate, up)
    assert h.dtype == torch.bfloat16
    # fp32 math on the same bf16 values, one rounding of each output: 1 half-ulp; 1 ulp bound
    assert_lowp_close(close, h, fwd(gate.float(), up.float()), ulps=1, name="h")
    got = tri.backward(g, gate, up)
    ref = bwd(g.float(), gate.float(), up.float())
    for name, a, e in zip(("dgate", "dup"), got, ref):
        assert a.dtype == torch.bfloat16
        assert_lowp_close(close, a, e, ulps=1, name=name)


def test_shape_mismatch_raises():
    gate, up, _ = _inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match="up"):
        tri.forward(gate, up[:, :4].contiguous())
