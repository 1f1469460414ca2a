"""causal_attention against torch's SDPA (is_causal, repeat_kv), every backend that has it."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops.attention import causal_attention, causal_attention_reference, supported
from lorafuse.testing import assert_close, op_cases

CASES = op_cases("attention")
# (B, Hq, Hk, T, D): GQA with a length that is not a multiple of the 64-row block, plain MHA
# over two full blocks, one head of one block with a ragged end, T=2, and GQA over two 512-key
# blocks (the C++ kernel's online softmax).
SHAPES = [
    (2, 6, 2, 77, 16),
    (1, 4, 4, 128, 32),
    (1, 1, 1, 65, 8),
    (3, 2, 1, 2, 8),
    (1, 2, 1, 600, 8),
]


def _inputs(B, Hq, Hk, T, D, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=gen)
    k = torch.randn(B, Hk, T, D, generator=gen)
    # v as the model hands it: a (B, H, T, D) transpose of the (B, T, H, D) projection.
    v = torch.randn(B, T, Hk, D, generator=gen).transpose(1, 2)
    go = torch.randn(B, T, Hq, D, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, go)]


def _run(fn, q, k, v, go):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, go)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_fp32(backend, device, shape):
    q, k, v, go = _inputs(*shape, device=device)
    scale = shape[-1] ** -0.5
    want, wgrads = _run(lambda *t: causal_attention_reference(*t, scale), q, k, v, go)
    got, grads = _run(lambda *t: causal_attention(*t, scale, backend=backend), q, k, v, go)
    assert got.shape == (shape[0], shape[3], shape[1], shape[4]) and got.is_contiguous()
    # fp32 with a different summation order (block sgemm vs the flash kernel's tiles)
    assert_close(got, want, atol=2e-6, rtol=1e-5, name="out")
    for name, g, w in zip(("dq", "dk", "dv"), grads, wgrads):
        assert g.shape == w.shape
        assert_close(g, w, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_attention_bf16_against_fp32_oracle(backend, device):
    shape = (2, 4, 2, 70, 16)
    q, k, v, go = _inputs(*shape, dtype=torch.bfloat16, device=device)
    scale = 0.3
    oracle, ograds = _run(
        lambda *t: causal_attention_reference(*(x.float() for x in t), scale),
        q, k, v, go.float(),
    )  # fmt: skip
    got, grads = _run(lambda *t: causal_attention(*t, scale, backend=backend), q, k, v, go)
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    # fp32 math, one rounding to bf16 per output (2^-8 relative), values O(1)
    assert_close(got.float(), oracle, atol=2e-2, rtol=1e-2, name="out")
    for name, g, w in zip(("dq", "dk", "dv"), grads, ograds):
        assert_close(g.float(), w, atol=3e-2, rtol=2e-2, name=name)


# (B, Hq, Hk, T, D) for the bf16 product paths: where oneDNN has a bf16 micro-kernel (AMX,
# AVX-512-BF16) a head dim that is a multiple of 16 runs the brgemm products: over two 512-key
# blocks; D = 80 as two packed panels (64 + 16) with a ragged last row block of an odd row count
# (3 heads x 3 rows). D = 8 runs MKL's bf16 GEMM on every CPU with native bf16.
BF16_SHAPES = [
    ((1, 4, 2, 600, 32), "brgemm"),
    ((1, 3, 1, 131, 80), "brgemm"),
    ((1, 4, 2, 150, 8), "mkl"),
]


@pytest.mark.cpp
@pytest.mark.parametrize("shape, products", BF16_SHAPES)
@pytest.mark.parametrize("cpu_low_precision", ["native", "emulated"], indirect=True)
def test_cpp_bf16_products_are_as_accurate_as_sdpa(cpu_low_precision, shape, products):
    """Where bf16 products are native the kernel multiplies bf16 operands (fp32 accumulation),
    elsewhere it upcasts to fp32; either way it is as close to the fp32 oracle as torch's own
    bf16 flash kernel (rms error, see testing.assert_as_accurate_as_stock)."""
    from lorafuse import _ext, backends, hardware
    from lorafuse.ops import attention
    from lorafuse.testing import assert_as_accurate_as_stock

    if not backends.cpp_ready("attention"):
        pytest.skip("C++ extension not built here")
    q, k, v, go = _inputs(*shape, dtype=torch.bfloat16, seed=1)
    native = hardware.matmul_dtype(q.device, torch.bfloat16) == torch.bfloat16
    assert attention.kernel_dtype(q) == (torch.bfloat16 if native else torch.float32)
    # The brgemm products run where oneDNN has a bf16 micro-kernel (AMX or AVX-512-BF16, whatever
    # the low-precision branch), mkldnn enabled.
    micro_kernel = bool({"amx_bf16", "avx512_bf16"} & hardware.cpu_flags())
    want = products if micro_kernel and torch.backends.mkldnn.enabled else "mkl"
    assert _ext.load_cpp().attention_bf16_products(shape[-1]) == want
    scale = shape[-1] ** -0.5
    oracle = _run(
        lambda *t: causal_attention_reference(*t, scale), *(t.float() for t in (q, k, v, go))
    )
    stock = _run(lambda *t: causal_attention_reference(*t, scale), q, k, v, go)
    ours = _run(lambda *t: causal_attention(*t, scale, backend="cpp"), q, k, v, go)
    for name, o, s, w in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[1]),
                             (stock[0], *stock[1]), (oracle[0], *oracle[1])):  # fmt: skip
        assert o.dtype == torch.bfloat16
        assert_as_accurate_as_stock(o.detach(), s.detach(), w.detach(), name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_attention_is_causal(backend, device):
    """Changing the last key/value changes only the last query's output."""
    q, k, v, _ = _inputs(1, 2, 1, 9, 8, device=device)
    with torch.no_grad():
        base = causal_attention(q, k, v, 0.5, backend=backend)
        k2, v2 = k.clone(), v.clone()
        k2[:, :, -1] += 1.0
        v2[:, :, -1] -= 1.0
        moved = causal_attention(q, k2, v2, 0.5, backend=backend)
    assert torch.equal(base[:, :-1], moved[:, :-1])
    assert not torch.equal(base[:, -1], moved[:, -1])


def test_supported_is_the_plain_training_case():
    q, k, _, _ = _inputs(1, 2, 1, 9, 8)
    assert supported(q, k)
    assert not supported(q, k, attention_mask=torch.ones(1, 1, 9, 9, dtype=torch.bool))
    assert not supported(q, k, dropout=0.1)
    assert not supported(q, k, sliding_window=4) and supported(q, k, sliding_window=9)
    assert not supported(q[:, :, :1], k[:, :, :1])  # one query: decoding
    assert not supported(q[:, :, -3:], k)  # queries after a KV cache


def test_attention_errors_name_the_problem():
    q, k, v, _ = _inputs(1, 3, 2, 5, 8)
    with pytest.raises(ValueError, match="Hq a multiple of Hk"):
        causal_attention(q, k, v, 1.0)
    q, k, v, _ = _inputs(1, 2, 1, 5, 8)
    with pytest.raises(ValueError, match="share a float dtype"):
        causal_attention(q, k.double(), v, 1.0)
    with pytest.raises(ValueError, match=r"q must be \(B, Hq, T, D\)"):
        causal_attention(q[0], k, v, 1.0)


@pytest.mark.cpp
def test_cpp_kernel_finds_torchs_blas():
    """The kernel's sgemm comes from torch's own libraries and passed its self-test."""
    from lorafuse import _ext, backends

    if not backends.cpp_available():
        pytest.skip("C++ extension not built here")

    assert _ext.load_cpp().attention_available()


def _cpp_or_skip():
    from lorafuse import _ext, backends

    if not backends.cpp_available():
        pytest.skip("C++ extension not built here")
    return _ext.load_cpp()


@pytest.mark.cpp
def test_cpp_softmax_exp_is_within_2_ulp():
    """The kernel's own exp (common.h exp_fast) against float64 exp: <= 2 ulp where the result is a
    normal float (measured max 1.04), within one denormal step below, exp(0) = 1 exactly (every
    row's largest score), 0 for -inf and below -103.3, inf above 88.73, NaN for NaN."""
    ext = _cpp_or_skip()
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.linspace(-110.0, 90.0, 1 << 20),
        torch.rand(1 << 20, generator=gen) * -30.0,  # the softmax's range (scores minus the max)
        torch.randn(1 << 16, generator=gen) * 1e-6,  # around 0, where exp is close to 1
        torch.tensor([0.0, -0.0, -87.3, -88.0, -103.0, -104.0, -1e4, 88.7, 88.8, 1e4]),
        torch.tensor([float("-inf"), float("inf"), float("nan")]),
    ])  # fmt: skip
    x = torch.cat([x, torch.zeros(-len(x) % 16)])  # whole vectors
    got = ext.attention_exp(x).double()
    want = torch.exp(x.double())
    tiny = torch.finfo(torch.float32).tiny
    normal = (want >= tiny) & (want <= torch.finfo(torch.float32).max)
    w32 = want[normal].float()
    ulp = (torch.nextafter(w32, torch.tensor(float("inf"))) - w32).double()
    err = ((got[normal] - want[normal]).abs() / ulp).max().item()
    assert err <= 2.0, f"exp error {err:.2f} ulp"
    below = want < tiny  # denormal results (and 0): within one step of 2^-149
    assert (got[below] - want[below]).abs().max().item() <= 2.0**-149
    assert got[x == 0].eq(1.0).all()
    assert got[x == float("-inf")].eq(0.0).all() and got[x <= -104].eq(0.0).all()
    assert got[x >= 88.8].isinf().all() and got[x.isnan()].isnan().all()


@pytest.mark.cpp
@pytest.mark.parametrize("native", [True, False])
def test_cpp_bf16_rounding_is_tensor_to(native):
    """P, dS and the outputs are rounded by AVX-512-BF16's VCVTNEPS2BF16 where the CPU has it, which
    treats denormal inputs as zero: vectors holding one take ATen's conversion, so either path is
    bit for bit tensor.to(bfloat16) (NaN as some NaN). Ragged lengths cover the masked tail."""
    ext = _cpp_or_skip()
    if ext.attention_bf16_rounding() == "native":
        assert torch.cpu._is_avx512_bf16_supported()
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int32)
    ties = (torch.randint(0, 2**15, (4096,), generator=gen, dtype=torch.int32) << 16) | 0x8000
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 1.1754942e-38, 3.4e38, float("inf"), -1.0])
    for n in (1, 15, 17, 33, 1000):
        x = torch.cat([bits.view(torch.float32), ties.view(torch.float32), special])
        x = torch.cat([x, torch.randn(n, generator=gen) * 1e-39])  # denormals in the ragged tail
        got, want = ext.attention_round_bf16(x, native), x.to(torch.bfloat16)
        nan = x.isnan()
        assert got[nan].isnan().all()
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_missing_blas_warns_once_and_uses_sdpa(monkeypatch):
    """The BLAS self-test is part of the one kernel choice: a failing one makes select() answer
    torch (warned once, recorded with the reason), so the patcher and the op agree."""
    from lorafuse import backends

    monkeypatch.setattr(backends, "cpp_available", lambda: True)
    monkeypatch.setattr(backends, "compiled", lambda op, backend, *names: (lambda: False,))
    backends.cpp_ready.cache_clear()
    q, k, v, _ = _inputs(1, 2, 1, 9, 8)
    try:
        with pytest.warns(RuntimeWarning, match="no BLAS sgemm"):
            out = causal_attention(q, k, v, 0.5, backend="cpp")
        assert torch.equal(out, causal_attention_reference(q, k, v, 0.5))
        assert backends.choices()["attention (cpu)"] == "torch: C++ kernel unavailable"
    finally:
        backends.cpp_ready.cache_clear()


def test_auto_runs_torch_past_the_measured_crossover_length(monkeypatch, cpu_low_precision):
    """Past ``AUTO_MAX_LENGTH`` (fp32 products: 1024, native bf16: 2048 tokens, 8192 through
    oneDNN's brgemm) torch's flash kernel was measured faster, so ``auto`` runs it there and says
    why; an explicit ``cpp`` request still gets the C++ kernel. Head dims 8 (MKL's bf16 GEMM where
    bf16 is native) and 16 (brgemm where oneDNN has a bf16 micro-kernel, AMX or AVX-512-BF16)."""
    from lorafuse import _ext, backends
    from lorafuse.ops import attention

    if not backends.cpp_ready("attention"):
        pytest.skip("C++ extension not built here")
    limits = {"fp32": 8, "native low precision": 4, "native bf16 (brgemm)": 6}
    monkeypatch.setattr(attention, "AUTO_MAX_LENGTH", limits)
    native = cpu_low_precision == "native"
    brgemm = native and _ext.load_cpp().attention_bf16_products(16) == "brgemm"
    g = torch.Generator().manual_seed(0)
    for dtype, D, limit in (
        (torch.float32, 8, 8),
        (torch.bfloat16, 8, 4 if native else 8),
        (torch.bfloat16, 16, (6 if brgemm else 4) if native else 8),
    ):
        for T, want in ((limit, "cpp"), (limit + 1, "torch")):
            q, k, v = (torch.randn(1, h, T, D, generator=g).to(dtype) for h in (2, 1, 1))
            out = attention.causal_attention(q, k, v, 0.35, backend="auto")
            choice = backends.choices()["attention (cpu)"]
            assert choice.startswith(want), (dtype, D, T, choice)
            if want == "torch":
                assert f"{T} > {limit} tokens" in choice
                assert torch.equal(out, attention.causal_attention_reference(q, k, v, 0.35))
        attention.causal_attention(q, k, v, 0.35, backend="cpp")
        assert backends.choices()["attention (cpu)"].startswith("cpp")
