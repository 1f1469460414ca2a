"""The rank-r LoRA products of ``csrc/lora_rank.cpp`` (register-blocked fp32 FMA kernels that
convert the large operand in registers, or the fp32 row tiles they replaced; where bf16 is native,
bf16x3: whole bf16 GEMMs of the fp32 operand split in three bf16 parts) against plain float64 math, and the two paths that use them: ``lora_linear``'s C++
kernel and the stacked projections of ``ops/lora_projection.py`` with the cpp backend. With fp32
adapters on a bf16 base neither may allocate a full-size fp32 tensor any more."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lorafuse import backends
from lorafuse.ops import lora_rank
from lorafuse.ops.lora_linear import lora_linear
from lorafuse.ops.lora_mlp import LoRAMLPFunction
from lorafuse.ops.lora_params import LoRAParams
from lorafuse.ops.lora_projection import flatten, meta_of
from lorafuse.ops.lora_split import split_backward, split_forward
from lorafuse.testing import assert_close

pytestmark = [
    pytest.mark.cpp,
    pytest.mark.skipif(not backends.cpp_available(), reason="C++ extension not built here"),
]

# (N, d, k, r). Tile rows are 512 KiB / (4·width), clamped to [8, 1024]: width 4100 -> 31 rows,
# so N = 100 is 3 full tiles + 7 rows (two parallel chunks); N = 20 is less than one tile; width
# 7 -> 1024 rows, N = 2100 is 2 full tiles + 52 rows; k = 1 and r = 1 are the degenerate widths.
# The FMA kernels (lora_rank_fma.cpp) take rows in groups of 64 and blocks of 1-16 (by r and the
# products asked for), columns by vectors of 16 (AVX-512) or 8 and ranges of 4096 / r: N = 100,
# 2100, 37, 70, 45, 67, 30 end in partial groups and blocks; widths 4100, 129, 7, 77, 33, 130, 61,
# 150, 90 end in partial vectors, 4100 spans several ranges; r = 1, 3, 2, 4, 8, 24 pad a vector,
# 16 does not; past 2 vectors (64, 100 on AVX-512) xa, gB/dB and dA take the fp32 tiles, the adds
# the FMA kernel still.
SHAPES = [
    (100, 4100, 129, 16),
    (100, 129, 4100, 1),
    (20, 4100, 1, 3),
    (2100, 7, 5, 2),
    (37, 77, 50, 4),
    (70, 33, 130, 8),
    (45, 200, 61, 24),
    (67, 150, 90, 64),
    (30, 40, 20, 100),
]


@pytest.fixture(params=["fma", "tiles", "bf16x3"])
def rank_kernels(request):
    """The machine's default (FMA kernels, bf16x3 on AMX), with set_rank_fma(False) the fp32 tiles
    they replaced (kept for benchmarks), or bf16x3 wherever bf16 is native and MKL's bf16 GEMM is
    there (by default AMX only): all must stay exact on every CPU."""
    from lorafuse import _ext

    ext = _ext.load_cpp()
    if request.param == "bf16x3" and not ext.bf16_gemm_available():
        pytest.skip("no MKL bf16 GEMM in this torch build")
    ext.lora_rank_set_fma(request.param != "tiles")
    ext.lora_rank_set_bf16x3("on" if request.param == "bf16x3" else "auto")
    try:
        yield request.param
    finally:
        ext.lora_rank_set_fma(True)
        ext.lora_rank_set_bf16x3("auto")


def _ops():
    names = ("down", "up_add_", "grads", "dA", "dx_add_")
    return dict(zip(names, backends.compiled("lora_rank", "cpp", *names)))


def _data(N, d, k, r, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=gen).to(dtype)  # (N, d) the large operands, any dtype
    g = torch.randn(N, k, generator=gen).to(dtype)  # (N, k)
    A = torch.randn(r, d, generator=gen) / d**0.5  # (r, d) fp32
    B = torch.randn(k, r, generator=gen) / r**0.5  # (k, r) fp32
    xa = torch.randn(N, r, generator=gen)  # (N, r) fp32
    mask = torch.rand(N, d, generator=gen) > 0.3  # (N, d) keep-mask
    return x, g, A, B, xa, mask


def _fp32_close(got, want, name):
    # fp32 products of exact fp32 operands (bf16/fp16 -> fp32 is exact) vs float64: sums of up
    # to 4100 terms in another order, 1e-5 of the tensor's scale bounds that.
    assert got.dtype == torch.float32, f"{name}: dtype {got.dtype}"
    assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5, name=name)


def _fp32_accurate(got, oracle, ref32, abs_sum, name):
    """``got`` is as accurate as the fp32 torch expression ``ref32``, against the float64
    ``oracle``, in units of 2^-24 of ``abs_sum`` (the same product of the operands' absolute
    values: the scale of an fp32 sum's rounding errors). Both sum the same exact products in
    fp32 (bf16/fp16 -> fp32 and, for bf16x3, bf16·bf16 are exact) in other orders: their
    worst-case bounds are equal, the largest errors seen over a tensor differ by a small factor
    (2), and bf16x3 adds its three parts' sums with two more roundings (2 units). A lost bf16x3
    part would be 2^-17 (S3) or 2^-9 (S2) of the scale: 128 units or more."""
    scale = abs_sum + torch.finfo(torch.float32).tiny  # denormal products may be flushed
    unit = 2.0**-24

    def err(t):
        return float(((t.double() - oracle).abs() / scale).max()) / unit

    e_got, e_ref = err(got), err(ref32)
    assert e_got <= 2 * e_ref + 2, f"{name}: {e_got:.2f} units vs fp32 reference {e_ref:.2f}"


def assert_within_one_ulp(got, want, name, *, max_moved=0.01):
    """``got`` equals ``want`` (both in one low-precision dtype), or sits one ulp from it.

    ``want`` is the float64 result rounded once. The kernel rounds an fp32 sum once; the two
    differ where that fp32 value (another summation order: ~2^-20 of the magnitudes summed) and
    the exact one fall on the two sides of a rounding midpoint, by one ulp, at a rate of ~2^-20 /
    2^-8 per element (``max_moved``, 1%, bounds the count with a wide margin). Results that
    cancel to near zero have ulps below that fp32 error: 2^-18 of the output's scale allows for
    it. A second rounding (an fp32 term rounded to bf16 before it is added) moves far more
    elements, by more.
    """
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    eps = torch.finfo(want.dtype).eps  # spacing at 1.0
    w = want.detach().double()
    ulp = eps * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(torch.finfo(want.dtype).tiny))))
    bound = ulp + 2**-18 * w.abs().max()
    diff = (got.detach().double() - w).abs()
    assert bool((diff <= bound).all()), f"{name}: max {float((diff / ulp).max()):.2f} ulp off"
    moved = float((diff > 0).double().mean())
    assert moved <= max_moved, f"{name}: {moved:.2%} of the elements moved"


@pytest.mark.parametrize("cpu_low_precision", ["native", "emulated"], indirect=True)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rank_products_match_float64(shape, dtype, cpu_low_precision, rank_kernels):
    """Each product against float64, and as accurate as the fp32 torch expression. bf16 on the
    native branch runs bf16x3 (where MKL's bf16 GEMM is there), everything else the FMA kernels
    (or the fp32 tiles) or one fp32 GEMM: these bounds hold for all."""
    N, d, k, r = shape
    ops = _ops()
    x, g, A, B, xa, mask = _data(N, d, k, r, dtype)
    keep, s = 0.7, 1.5
    noise = mask.double() / keep  # dropout(x) = x·mask/keep
    X, G = x.double(), g.double()
    xf, gf, Ad, Bd, xad = x.float(), g.float(), A.double(), B.double(), xa.double()

    def check(got, oracle, ref32, abs_sum, name):
        _fp32_close(got, oracle, name)
        _fp32_accurate(got, oracle, ref32, abs_sum, name)

    for m, nz in ((None, 1.0), (mask, noise)):
        xm = xf if m is None else xf * m / keep  # (N, d) dropout(x) in fp32
        check(ops["down"](x, A, m, keep), (X * nz) @ Ad.t(), xm @ A.t(),
              (X * nz).abs() @ Ad.abs().t(), "down")  # fmt: skip
    gB, dB = ops["grads"](g, B, xa, s, True, True)
    check(gB, s * G @ Bd, (gf @ B) * s, s * G.abs() @ Bd.abs(), "gB")
    check(dB, s * G.t() @ xad, (gf.t() @ xa) * s, s * G.abs().t() @ xad.abs(), "dB")
    only_gB, no_dB = ops["grads"](g, B, xa, s, True, False)
    assert no_dB is None and torch.equal(only_gB, gB)
    assert ops["grads"](g, B, xa, s, False, True)[0] is None
    for m, nz in ((None, 1.0), (mask, noise)):
        xm = xf if m is None else xf * m / keep
        check(ops["dA"](xa, x, m, keep), xad.t() @ (X * nz), xa.t() @ xm,
              xad.abs().t() @ (X * nz).abs(), "dA")  # fmt: skip
    y = torch.randn(N, k).to(dtype)  # (N, k) the output the up product is added into
    want_y = y.double() + s * xa.double() @ B.double().t()
    ops["up_add_"](y, xa, B, s)
    dx = torch.randn(N, d).to(dtype)
    want_dx = dx.double() + (xa.double() @ A.double()) * noise
    ops["dx_add_"](dx, xa, A, mask, keep)
    if dtype == torch.float32:
        _fp32_close(y, want_y, "y")
        _fp32_close(dx, want_dx, "dx")
    else:
        assert_within_one_ulp(y, want_y.to(dtype), "y")
        assert_within_one_ulp(dx, want_dx.to(dtype), "dx")


@pytest.mark.parametrize("cpu_low_precision", ["native", "emulated"], indirect=True)
def test_rank_products_split_fp32_operands_exactly(cpu_low_precision, rank_kernels):
    """bf16x3 claims S = S1 + S2 + S3 exactly for fp32 S of normal magnitude: multiplied by an
    identity x, xa = x·Aᵀ must return Aᵀ bit for bit (each element one product, its three parts
    added exactly), also for values with all 24 significant bits set and across the exponent
    range. Below ~2^-110 the parts S2, S3 become bf16 denormals, which the bf16 units read as zero:
    an error under 2^-126 per product. The fp32 tiles are exact there too."""
    ops = _ops()
    gen = torch.Generator().manual_seed(4)
    d, r = 64, 16
    x = torch.eye(d, dtype=torch.bfloat16)  # (d, d) as the large operand, N = d
    mant = 1 + torch.rand(r, d, generator=gen)  # [1, 2): random 24-bit significands
    mant[0] = 2 - 2.0**-23  # all 24 bits set
    expo = torch.randint(-100, 100, (r, d), generator=gen).float()
    sign = torch.where(torch.rand(r, d, generator=gen) < 0.5, -1.0, 1.0)
    A = sign * mant * torch.exp2(expo)  # (r, d) fp32, |A| in [2^-100, 2^101)
    assert torch.equal(ops["down"](x, A, None, 1.0), A.t())
    assert torch.equal(ops["dA"](A.t().contiguous(), x, None, 1.0), A)  # gBᵀ·I = gBᵀ
    tiny = mant * 2.0**-120  # S2, S3 below bf16's smallest normal
    err = (ops["down"](x, tiny, None, 1.0) - tiny.t()).abs().max().item()
    assert err <= (2.0**-126 if lora_rank.cpp_rank_bf16x3() else 0.0), err


@pytest.mark.parametrize("cpu_low_precision", ["native", "emulated"], indirect=True)
def test_rank_products_keep_non_finite_values_non_finite(cpu_low_precision, rank_kernels):
    """An inf or NaN in either operand gives a non-finite result exactly where the fp32
    expression has one (bf16x3 may turn an inf into NaN: inf·0 for a zero part, inf - inf in the
    split of an inf; a training step with either is lost anyway)."""
    ops = _ops()
    x, g, A, B, xa, _ = _data(40, 96, 48, 4, torch.bfloat16)
    x[3, 5], g[7, 1] = float("inf"), float("nan")
    A[1, 9], B[2, 3], xa[5, 2] = float("-inf"), float("inf"), float("nan")
    gB, dB = ops["grads"](g, B, xa, 1.0, True, True)
    for name, got, want in (
        ("down", ops["down"](x, A, None, 1.0), x.float() @ A.t()),
        ("gB", gB, g.float() @ B),
        ("dB", dB, g.float().t() @ xa),
        ("dA", ops["dA"](xa, x, None, 1.0), xa.t() @ x.float()),
    ):
        assert torch.equal(got.isfinite(), want.isfinite()), name


@pytest.mark.parametrize("cpu_low_precision", ["native", "emulated"], indirect=True)
def test_rank_products_take_strided_small_operands_and_empty_inputs(
    cpu_low_precision, rank_kernels
):
    ops = _ops()
    x, g, A, B, xa, _ = _data(100, 4100, 129, 16, torch.bfloat16)
    cols = torch.randn(100, 20)[:, 3:19]  # (N, 16) a column block of a stacked xa, row stride 20
    y = torch.zeros(100, 129, dtype=torch.bfloat16)
    ops["up_add_"](y, cols, B, 1.0)
    assert_within_one_ulp(y, (cols.double() @ B.double().t()).bfloat16(), "y")
    _fp32_close(ops["grads"](g, B, cols, 1.0, False, True)[1], g.double().t() @ cols.double(), "dB")
    empty = torch.zeros(0, 4100, dtype=torch.bfloat16)
    assert ops["down"](empty, A, None, 1.0).shape == (0, 16)
    assert torch.equal(ops["dA"](torch.zeros(0, 16), empty, None, 1.0), torch.zeros(16, 4100))


def test_rank_products_name_bad_shapes_and_dtypes():
    ops = _ops()
    x, g, A, B, xa, _ = _data(10, 8, 6, 2, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"A must be \(2, 8\)"):
        ops["down"](x, A[:, :7], None, 1.0)
    with pytest.raises(RuntimeError, match="B must be float32"):
        ops["grads"](g, B.bfloat16(), xa, 1.0, True, True)
    with pytest.raises(RuntimeError, match="y must be float32, bfloat16 or float16"):
        ops["up_add_"](torch.zeros(10, 6, dtype=torch.float64), xa, B, 1.0)


def _big_allocations(fn, nbytes: int) -> list[tuple[str, int]]:
    """``(op, bytes)`` of every allocation of at least ``nbytes`` while ``fn`` runs (the
    profiler's memory records, by the op that made them: ops' own memory, not their children's)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.self_cpu_memory_usage) for e in prof.events()
            if e.self_cpu_memory_usage >= nbytes]  # fmt: skip


@pytest.mark.parametrize("cpu_low_precision", ["native"], indirect=True)
def test_lora_linear_cpp_forms_no_full_size_fp32_tensor(cpu_low_precision):
    """fp32 adapters on a bf16 base with bf16 products native: the C++ forward + backward
    allocate nothing of an (N, d) or (N, k) fp32 tensor's size; the torch reference does (x, g
    cast to fp32; xa·Bᵀ and gB·A formed in fp32), which shows the check can fail. Sizes are
    chosen so that no bf16 tensor of the op ((N, k) 921,600 B) reaches N·d·4 = 1,228,800 B."""
    N, d, k, r = 300, 1024, 1536, 4  # 3 tiles of x, 5 of g: more rows than one tile holds
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, d, generator=gen).bfloat16().requires_grad_(True)
    w = (torch.randn(k, d, generator=gen) / d**0.5).bfloat16()
    A = (torch.randn(r, d, generator=gen) / d**0.5).requires_grad_(True)
    B = torch.randn(k, r, generator=gen).requires_grad_(True)
    g = torch.randn(N, k, generator=gen).bfloat16()

    def step(backend):
        y = lora_linear(x, w, None, A, B, 2.0, backend=backend)
        torch.autograd.grad(y, [x, A, B], g)

    full = N * min(d, k) * 4
    assert _big_allocations(lambda: step("torch"), full), "the reference should allocate"
    assert _big_allocations(lambda: step("cpp"), full) == []


@pytest.mark.parametrize("cpu_low_precision", ["native"], indirect=True)
def test_stacked_mlp_cpp_forms_no_full_size_fp32_tensor(cpu_low_precision):
    """The fused MLP with gate/up stacked (fp32 adapters on bf16, cpp): no allocation of an
    (N, d) or (N, I) fp32 tensor's size in forward + backward; with the torch backend there are."""
    N, d, inter, r = 300, 1024, 1536, 4
    gen = torch.Generator().manual_seed(1)

    def proj(d_in, d_out):
        w = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).bfloat16()
        A = (torch.randn(r, d_in, generator=gen) / d_in**0.5).requires_grad_(True)
        return LoRAParams(w, None, A, torch.randn(d_out, r, generator=gen).requires_grad_(True))

    params = [proj(d, inter), proj(d, inter), proj(inter, d)]
    x = torch.randn(N, d, generator=gen).bfloat16().requires_grad_(True)
    g = torch.randn(N, d, generator=gen).bfloat16()
    leaves = [x] + [t for p in params for t in (p.lora_A, p.lora_B)]

    def step(backend):
        args = (*flatten(params), meta_of(params), backend, backend, "silu", True)  # stacked
        torch.autograd.grad(LoRAMLPFunction.apply(x, *args), leaves, g)

    full = N * min(d, inter) * 4
    assert _big_allocations(lambda: step("torch"), full), "the reference should allocate"
    assert _big_allocations(lambda: step("cpp"), full) == []


def _fp32_or_one_ulp(got, want, name):
    if got.dtype == torch.float32:  # fp32 rank-r results of the same fp32 products, reordered
        assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5, name=name)
    else:  # the same fp32 term added into the same bf16 value, each rounded once
        assert_within_one_ulp(got, want, name)


@pytest.mark.parametrize("cpu_low_precision", ["native", "emulated"], indirect=True)
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_lora_linear_cpp_matches_torch_over_many_tiles(cpu_low_precision, p):
    """fp32 adapters on bf16 through the autograd Function, several tiles per operand (so the
    products run in two parallel chunks, on worker threads): cpp equals the torch backend up to
    fp32 summation order. With dropout, dx is rounded once as the reference rounds it."""
    N, d, k, r = 300, 1024, 1536, 4
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(N, d, generator=gen).bfloat16().requires_grad_(True)
    w = (torch.randn(k, d, generator=gen) / d**0.5).bfloat16()
    b = torch.randn(k, generator=gen).bfloat16()
    A = (torch.randn(r, d, generator=gen) / d**0.5).requires_grad_(True)
    B = torch.randn(k, r, generator=gen).requires_grad_(True)
    g = torch.randn(N, k, generator=gen).bfloat16()
    out = {}
    for backend in ("torch", "cpp"):
        torch.manual_seed(5)  # the same dropout mask
        y = lora_linear(x, w, b, A, B, 2.0, p, backend=backend)
        out[backend] = (y, *torch.autograd.grad(y, [x, A, B], g))
    (y, dx, dA, dB), (ry, rdx, rdA, rdB) = out["cpp"], out["torch"]
    _fp32_or_one_ulp(dA, rdA, "dA")
    _fp32_or_one_ulp(dB, rdB, "dB")
    # y and dx add the LoRA term into a frozen product that the two backends compute with
    # different calls (addmm vs F.linear; an fp32 GEMM when bf16 is emulated), whose bf16
    # roundings can differ by an ulp of that product: 2^-7 of the scale and of each value bounds
    # it. The single rounding of the term itself is checked in test_rank_products_match_float64.
    for name, got, want in (("y", y, ry), ("dx", dx, rdx)):
        assert got.dtype == torch.bfloat16
        assert_close(got, want, atol=2**-7 * want.abs().max().item(), rtol=2**-7, name=name)


@pytest.mark.parametrize("cpu_low_precision", ["native", "emulated"], indirect=True)
def test_stacked_cpp_matches_torch_over_many_tiles(cpu_low_precision):
    """split_forward / split_backward, q/k/v-like (GQA widths, one projection without an
    adapter), fp32 adapters on a bf16 base: the cpp rank products equal the torch expressions up
    to fp32 summation order (bf16 outputs: each rounded once)."""
    N, d, r = 300, 1024, 4
    gen = torch.Generator().manual_seed(3)

    def proj(out, lora=True):
        w = (torch.randn(out, d, generator=gen) / d**0.5).bfloat16()
        if not lora:
            return LoRAParams(w)
        A = torch.randn(r, d, generator=gen) / d**0.5
        return LoRAParams(w, None, A, torch.randn(out, r, generator=gen), 1.5)

    params = [proj(1536), proj(256, lora=False), proj(256)]
    x = torch.randn(N, d, generator=gen).bfloat16()
    gs = [torch.randn(N, p.out_features, generator=gen).bfloat16() for p in params]
    wants = [(True, True, False)] * 3
    res = {}
    for backend in ("torch", "cpp"):
        ys, xas = split_forward(x, params, backend=backend)
        dx, per = split_backward(gs, x, params, xas, True, wants, backend=backend)
        grads = [t for _, dA, dB in per for t in (dA, dB) if t is not None]
        res[backend] = (*ys, *[t for t in xas if t is not None], dx, *grads)
    for i, (got, want) in enumerate(zip(res["cpp"], res["torch"], strict=True)):
        _fp32_or_one_ulp(got, want, f"output {i}")
