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


def _backward_impl(backend):
    from lorafuse.ops import swiglu as swiglu_module

    return swiglu_module.implementation(backend)[1]


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_dgate_into_g(backend, device, dtype):
    """``dgate_into_g``: the same bits as a fresh dgate, written into g's own buffer (what the
    fused MLP's backward relies on to hold one (N, I) tensor fewer)."""
    gate, up, g = _inputs((5, 131), dtype, device=device)
    bwd = _backward_impl(backend)
    want_dgate, want_dup = bwd(g, gate, up)
    into = g.clone()
    dgate, dup = bwd(into, gate, up, dgate_into_g=True)
    assert dgate.data_ptr() == into.data_ptr() and dgate.dtype == dtype
    assert torch.equal(dgate, want_dgate) and torch.equal(dup, want_dup)


@pytest.mark.cpp
def test_cpp_swiglu_dgate_into_g_of_another_dtype_leaves_g_alone():
    """An fp32 g for bf16 gate/up: the kernel casts g, so dgate takes the cast copy's buffer and
    the caller's g is not overwritten."""
    _cpp_ext_or_skip()
    gate, up, g = _inputs((3, 70), torch.bfloat16)
    g32 = g.float()
    kept = g32.clone()
    dgate, dup = _backward_impl("cpp")(g32, gate, up, dgate_into_g=True)
    want_dgate, want_dup = _backward_impl("cpp")(g, gate, up)
    assert dgate.dtype == torch.bfloat16 and torch.equal(g32, kept)
    assert torch.equal(dgate, want_dgate) and torch.equal(dup, want_dup)


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


# ---- the C++ kernel's own math -------------------------------------------------------------

TINY = torch.finfo(torch.float32).tiny


def _cpp_ext_or_skip():
    from lorafuse import _ext, backends

    if not backends.cpp_available():
        pytest.skip("C++ extension not built here")
    return _ext.load_cpp()


def _z_over_sigmoids_range():
    """fp32 gates over sigmoid's whole range: both saturated tails, exp's overflow and
    denormal thresholds (±88.7, ±103), denormal and signed-zero gates, ±inf and NaN; an odd
    length, so the kernel's ragged end is in it too."""
    gen = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, 88.0, -88.0, 88.7, -88.7, 88.8, -88.8, 100.0, -100.0, 103.0, -103.0,
               104.0, -104.0, 1e4, -1e4, TINY, -TINY, 1e-40, -1e-40, 1e-45, -1e-45,
               float("inf"), float("-inf"), float("nan")]  # fmt: skip
    return torch.cat([
        torch.linspace(-120.0, 120.0, (1 << 20) + 1),
        torch.randn(1 << 18, generator=gen) * 4.0,  # where real gates live
        torch.randn(1 << 16, generator=gen) * 1e-6,  # around 0, where sigmoid is close to 1/2
        torch.tensor(special),
    ])  # fmt: skip


def _bits_equal(a, b):
    """Equal values, NaN where the other is NaN (a NaN's payload may differ)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.cpp
def test_cpp_swiglu_fp32_against_float64_oracle():
    """The C++ kernel's fp32 h, dgate and dup against the float64 formulas on the same inputs.

    Where sigmoid(z) is a normal float (z > -87.3) each output is within 4·2^-23 of its scale,
    relative (h, dup: the value; dgate: |g·up·s|·(1 + |z·(1 - s)|), the size of the terms of
    1 + z(1 - s), which cancel near z = -1.28): exp's 2 ulp, then at most five roundings of
    2^-24 (measured max 2.5·2^-23; the previous kernel reached 36·2^-23 for dgate near
    z = -86, where its 1 - s cancelled). Below, sigmoid is itself a denormal, exact only to its
    step 2^-149, which the factors after it scale: the bound adds
    2^-149·(1 + |z|)(1 + |up|)(1 + |g|) (measured at most half of it). ±inf and NaN gates give
    what float64 gives."""
    ext = _cpp_ext_or_skip()
    z = _z_over_sigmoids_range()
    gen = torch.Generator().manual_seed(1)
    up, g = torch.randn(z.shape, generator=gen), torch.randn(z.shape, generator=gen)
    h = ext.swiglu_forward(z[None], up[None])[0]
    dgate, dup = (t[0] for t in ext.swiglu_backward(g[None], z[None], up[None]))

    zd, ud, gd = z.double(), up.double(), g.double()
    s, one_minus_s = torch.sigmoid(zd), torch.sigmoid(-zd)  # float64: no cancellation to speak of
    dsilu_terms = 1 + (zd * one_minus_s).abs()
    floor = 2.0**-149 * (1 + zd.abs()) * (1 + ud.abs()) * (1 + gd.abs())
    for name, got, want, scale in (
        ("h", h, zd * s * ud, (zd * s * ud).abs()),
        ("dgate", dgate, gd * ud * s * (1 + zd * one_minus_s), (gd * ud * s).abs() * dsilu_terms),
        ("dup", dup, gd * zd * s, (gd * zd * s).abs()),
    ):
        finite = want.isfinite()
        assert _bits_equal(got.double()[~finite], want[~finite]), f"{name}: inf/NaN differ"
        err = (got.double() - want).abs()[finite]
        bound = (4 * 2.0**-23 * scale + floor)[finite]
        worst = int((err / bound).argmax())
        assert bool((err <= bound).all()), (
            f"{name}: error {err[worst].item():.3g} > bound {bound[worst].item():.3g} "
            f"at z = {z[finite][worst].item()!r}"
        )
    assert h[z == 0].eq(0).all() and dgate[z == 0].eq(g[z == 0] * up[z == 0] * 0.5).all()

    # The same bits wherever an element sits (vector body or ragged end, any thread split).
    assert _bits_equal(ext.swiglu_forward(z[None, 5:], up[None, 5:])[0], h[5:])
    shifted = ext.swiglu_backward(g[None, 3:], z[None, 3:], up[None, 3:])
    assert _bits_equal(shifted[0][0], dgate[3:]) and _bits_equal(shifted[1][0], dup[3:])


@pytest.mark.cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpp_swiglu_low_precision_is_fp32_rounded_once(dtype):
    """bf16 / fp16 storage: the kernel's fp32 results on the upcast inputs, rounded as
    ``tensor.to(dtype)`` rounds them, bit for bit: the native bf16 instruction (where the CPU has
    it) included, for denormal results as well (gates down to -104)."""
    ext = _cpp_ext_or_skip()
    gen = torch.Generator().manual_seed(2)
    n = 3 * 4099  # 3 rows of an odd length: ragged ends
    z = torch.cat([torch.linspace(-104.0, 104.0, n - 4096), torch.randn(4096, generator=gen) * 4])
    z = z.reshape(3, -1).to(dtype)
    up, g = (torch.randn(z.shape, generator=gen).to(dtype) for _ in range(2))
    h = ext.swiglu_forward(z, up)
    want_h = ext.swiglu_forward(z.float(), up.float()).to(dtype)
    assert _bits_equal(h, want_h)
    dgate, dup = ext.swiglu_backward(g, z, up)
    want_dgate, want_dup = ext.swiglu_backward(g.float(), z.float(), up.float())
    assert _bits_equal(dgate, want_dgate.to(dtype)) and _bits_equal(dup, want_dup.to(dtype))
