"""swiglu against the torch reference (F.silu(gate) * up), every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops.swiglu import swiglu, swiglu_reference
from lorafuse.testing import assert_close, op_cases

CASES = op_cases("swiglu")
SHAPES = [(1, 1, 1023), (3, 37, 129), (4, 96)]


def _inputs(shape, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=gen) * 4.0).to(device, dtype)  # both tails of sigmoid
    up = torch.randn(shape, generator=gen).to(device, dtype)
    g = torch.randn(shape, generator=gen).to(device, dtype)
    return gate, up, g


def _run(fn, gate, up, g):
    gate = gate.detach().clone().requires_grad_(True)
    up = up.detach().clone().requires_grad_(True)
    h = fn(gate, up)
    h.backward(g)
    return h, gate.grad, up.grad


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_fp32(backend, device, shape):
    gate, up, g = _inputs(shape, torch.float32, device=device)
    h, dg, du = _run(lambda a, b: swiglu(a, b, backend=backend), gate, up, g)
    rh, rdg, rdu = _run(swiglu_reference, gate, up, g)
    # Elementwise fp32 math, different association of the same few products.
    assert_close(h, rh, atol=1e-6, rtol=1e-5, name="h")
    assert_close(dg, rdg, atol=1e-6, rtol=1e-5, name="dgate")
    assert_close(du, rdu, atol=1e-6, rtol=1e-5, name="dup")


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_swiglu_bf16_against_fp32_oracle(backend, device, shape):
    gate, up, g = _inputs(shape, torch.bfloat16, device=device)
    h, dg, du = _run(lambda a, b: swiglu(a, b, backend=backend), gate, up, g)
    rh, rdg, rdu = _run(swiglu_reference, gate.float(), up.float(), g.float())
    assert h.dtype == dg.dtype == du.dtype == torch.bfloat16
    # fp32 math on exact bf16 inputs, one rounding to bf16 (2^-9 relative): 8e-3 is 2 ulps.
    # The absolute floor covers results that round to bf16 subnormal-ish tiny values near 0.
    assert_close(h, rh, atol=1e-5, rtol=8e-3, name="h")
    assert_close(dg, rdg, atol=1e-5, rtol=8e-3, name="dgate")
    assert_close(du, rdu, atol=1e-5, rtol=8e-3, name="dup")


def test_swiglu_frozen_side_gets_no_grad():
    gate, up, g = _inputs((3, 10), torch.float32)
    gate.requires_grad_(True)
    swiglu(gate, up, backend="torch").backward(g)
    assert gate.grad is not None and up.grad is None


def test_swiglu_matches_llama_mlp_activation():
    from transformers.activations import ACT2FN

    gate, up, _ = _inputs((2, 5, 24), torch.float32)
    assert_close(swiglu(gate, up), ACT2FN["silu"](gate) * up, atol=1e-6, rtol=1e-6, name="h")


def test_swiglu_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"gate \(2, 3\) and up \(2, 4\)"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="dtype"):
        swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))
