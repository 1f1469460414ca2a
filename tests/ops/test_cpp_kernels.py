"""Each C++ kernel called directly against the torch reference function of its op.

fp32: the same math in another summation order, so ~1e-5. bf16/fp16: the kernel on low-precision
inputs against the fp32 reference on the *same* values upcast (an fp32 oracle); the kernel
computes in fp32 and rounds the result once (rms_norm: twice, as HF does), so the error is a
few half-ulps of the output: rtol 2**-7 (= 2 bf16 ulps). Where outputs come from differences
of O(1) terms (gradients), an atol of 2**-7 * the term scale covers the rounding of those terms.

lora_linear's bf16 cases run under both CPU branches (``cpu_low_precision``): products in fp32
(emulated, AVX2) and native bf16 GEMMs (AVX-512-BF16 / AMX), whose inputs and output are bf16
but which accumulate in fp32; the kernel keeps its rank-r intermediates in fp32 in both, so the
same tolerances hold.
"""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch

from lorafuse.ops.rope import rope_reference
from lorafuse.testing import assert_close

pytestmark = pytest.mark.cpp

SHAPES = [(1, 1023), (111, 129), (4, 8)]
LOW = [torch.bfloat16, torch.float16]
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
LOW_TOL = dict(atol=2**-7, rtol=2**-7)


@pytest.fixture(scope="module")
def ext():
    from lorafuse import _ext

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine")
    return _ext.load_cpp()  # a build error here is a test error, never a skip


def reference(op: str, name: str):
    """The op's torch reference function, ``lorafuse.ops.<op>._torch_forward`` / ``_backward``."""
    return getattr(importlib.import_module(f"lorafuse.ops.{op}"), name)


def tol(dtype, scale=1.0):
    if dtype == torch.float32:
        return dict(atol=FP32_TOL["atol"] * scale, rtol=FP32_TOL["rtol"])
    return dict(atol=LOW_TOL["atol"] * scale, rtol=LOW_TOL["rtol"])


# ---- lora_linear --------------------------------------------------------------------------


def _lora_inputs(N, d, k, r, dtype, adapter_dtype, bias, dropout):
    gen = torch.Generator().manual_seed(N * 1000 + d)
    x = torch.randn(N, d, generator=gen).to(dtype)
    w = (torch.randn(k, d, generator=gen) / d**0.5).to(dtype)
    b = torch.randn(k, generator=gen).to(dtype) if bias else None
    A = (torch.randn(r, d, generator=gen) / d**0.5).to(adapter_dtype)
    B = (torch.randn(k, r, generator=gen) / r**0.5).to(adapter_dtype)
    mask = (torch.rand(N, d, generator=gen) > 0.25) if dropout else None
    g = torch.randn(N, k, generator=gen).to(dtype)
    return x, w, b, A, B, mask, g


@pytest.mark.parametrize("N,d", SHAPES)
@pytest.mark.parametrize("r", [1, 16])
@pytest.mark.parametrize("bias,dropout", [(True, False), (False, True)])
@pytest.mark.parametrize(
    "dtype,adapter_dtype,cpu_low_precision",
    [
        (torch.float32, torch.float32, "native"),  # fp32 does not depend on the branch
        (torch.bfloat16, torch.float32, "native"),
        (torch.bfloat16, torch.float32, "emulated"),
        (torch.bfloat16, torch.bfloat16, "native"),
        (torch.bfloat16, torch.bfloat16, "emulated"),
    ],
    indirect=["cpu_low_precision"],
)
def test_lora_linear(ext, N, d, r, bias, dropout, dtype, adapter_dtype, cpu_low_precision):
    from lorafuse.ops.lora_linear import _torch_backward, _torch_forward

    k, s, keep = 65, 2.0, 0.75
    x, w, b, A, B, mask, g = _lora_inputs(N, d, k, r, dtype, adapter_dtype, bias, dropout)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    y_ref, xa_ref = _torch_forward(f32(x), f32(w), f32(b), f32(A), f32(B), s, mask, keep)
    y, xa = ext.lora_linear_forward(x, w, b, A, B, s, mask, keep)
    assert y.dtype == dtype and xa.dtype == adapter_dtype
    # y sums d products of O(1/sqrt(d)) terms plus bias: O(1) (scale 4 covers the LoRA term)
    assert_close(y, y_ref, **tol(dtype, 4), name="y")
    assert_close(xa, xa_ref, **tol(adapter_dtype), name="xa")
    needs = (True, True, True, bias)
    ref = _torch_backward(f32(g), f32(x), f32(w), f32(A), f32(B), xa_ref, s, mask, keep, needs)
    got = ext.lora_linear_backward(g, x, w, A, B, xa, s, mask, keep, needs)
    for name, a, e, dt, scale in zip(
        ("dx", "dA", "dB", "db"),
        got,
        ref,
        (dtype, adapter_dtype, adapter_dtype, dtype),
        (4, 4 * N**0.5, 4 * N**0.5, N**0.5),  # dA/dB/db sum N terms: error grows like sqrt(N)
    ):
        if e is None:
            assert a is None, f"{name} was not asked for"
            continue
        assert a.dtype == dt, f"{name} dtype {a.dtype} != {dt}"
        assert_close(a, e, **tol(dt, scale), name=name)


@pytest.mark.parametrize("needs", [(True, False, False, False), (False, True, True, False)])
def test_lora_linear_only_requested_grads(ext, needs):
    x, w, b, A, B, mask, g = _lora_inputs(5, 33, 7, 4, torch.float32, torch.float32, False, True)
    _, xa = ext.lora_linear_forward(x, w, b, A, B, 1.0, mask, 0.5)
    got = ext.lora_linear_backward(g, x, w, A, B, xa, 1.0, mask, 0.5, needs)
    assert [t is not None for t in got] == list(needs)


def test_lora_linear_rejects_bad_shapes(ext):
    x, w, b, A, B, mask, g = _lora_inputs(5, 33, 7, 4, torch.float32, torch.float32, True, True)
    with pytest.raises(RuntimeError, match="lora_B"):
        ext.lora_linear_forward(x, w, b, A, B.t().contiguous(), 1.0, None, 1.0)
    with pytest.raises(RuntimeError, match="mask"):
        ext.lora_linear_forward(x, w, b, A, B, 1.0, mask[:, :5].contiguous(), 0.5)


def test_matmul_policy_matches_backends(ext, cpu_low_precision):
    """The loaded extension follows $LORAFUSE_CPU_LOW_PRECISION (re-applied by the fixture)."""
    from lorafuse import backends

    cpu = torch.device("cpu")
    native = cpu_low_precision == "native"
    assert backends.native_low_precision_matmul(cpu, torch.bfloat16) == native
    assert ext.native_low_precision() == (native, native)


# ---- rms_norm -----------------------------------------------------------------------------


@pytest.mark.parametrize("N,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_rms_norm(ext, N, d, dtype):
    fwd = reference("rms_norm", "_torch_forward")
    bwd = reference("rms_norm", "_torch_backward")
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(N, d, generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    g = torch.randn(N, d, generator=gen).to(dtype)
    y, rstd = ext.rms_norm_forward(x, w, 1e-6)
    # The oracle keeps the HF rounding of x·rstd to x's dtype, so it is the same-dtype reference.
    y_ref, rstd_ref = fwd(x, w, 1e-6)
    assert y.dtype == dtype and rstd.dtype == torch.float32
    assert_close(rstd, rstd_ref, **FP32_TOL, name="rstd")
    assert_close(y, y_ref, **tol(dtype), name="y")
    dx_ref, dw_ref = bwd(g.float(), x.float(), w.float(), rstd_ref, (True, True))
    if dtype != torch.float32:  # dw multiplies by the rounded normalised x, as the forward did
        _, dw_ref = bwd(g, x, w, rstd_ref, (False, True))
        dw_ref = dw_ref.float()
    dx, dw = ext.rms_norm_backward(g, x, w, rstd, (True, True))
    assert dx.dtype == dtype and dw.dtype == dtype
    assert_close(dx, dx_ref, **tol(dtype, 2), name="dx")  # x*rstd, g*w: O(2) terms
    assert_close(dw, dw_ref, **tol(dtype, N**0.5), name="dw")  # sum over N rows
    only_dw = ext.rms_norm_backward(g, x, w, rstd, (False, True))
    assert only_dw[0] is None
    assert torch.equal(only_dw[1], dw)  # blocked reduction: deterministic, same with or w/o dx


# ---- swiglu -------------------------------------------------------------------------------


@pytest.mark.parametrize("N,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_swiglu(ext, N, d, dtype):
    fwd = reference("swiglu", "_torch_forward")
    bwd = reference("swiglu", "_torch_backward")
    gen = torch.Generator().manual_seed(d)
    gate = (torch.randn(N, d, generator=gen) * 4).to(dtype)  # reaches silu's saturated tails
    up, g = (torch.randn(N, d, generator=gen).to(dtype) for _ in range(2))
    h = ext.swiglu_forward(gate, up)
    assert h.dtype == dtype
    assert_close(h, fwd(gate.float(), up.float()), **tol(dtype, 4), name="h")
    dgate, dup = ext.swiglu_backward(g, gate, up)
    dgate_ref, dup_ref = bwd(g.float(), gate.float(), up.float())
    assert_close(dgate, dgate_ref, **tol(dtype, 4), name="dgate")
    assert_close(dup, dup_ref, **tol(dtype, 4), name="dup")


def test_swiglu_extremes(ext):
    gate = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, -1e-30, 3.0, float("inf")]])
    up = torch.ones_like(gate)
    h = ext.swiglu_forward(gate, up)
    assert h[0, 7] == float("inf")  # silu(inf) = inf, not nan
    assert_close(h[:, :7], torch.nn.functional.silu(gate[:, :7]), **FP32_TOL, name="h")
    dgate, dup = ext.swiglu_backward(up, gate, up)
    assert bool(torch.isfinite(dgate[:, :7]).all()) and bool(torch.isfinite(dup[:, :7]).all())


# ---- rope ---------------------------------------------------------------------------------


def _cos_sin(B, T, D, dtype, gen):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    pos = torch.randint(0, 500, (B, T), generator=gen).float()
    ang = torch.cat([pos[..., None] * inv] * 2, dim=-1)  # (B, T, D)
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("B,Hq,Hk,T,D", [(1, 1, 1, 1, 2), (2, 4, 2, 7, 64), (1, 3, 1, 5, 18)])
@pytest.mark.parametrize(
    "dtype,cos_dtype",
    [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)],
)
def test_rope(ext, B, Hq, Hk, T, D, dtype, cos_dtype):
    fwd = reference("rope", "_torch_forward")
    bwd = reference("rope", "_torch_backward")
    gen = torch.Generator().manual_seed(D)
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hk, T, D, generator=gen).to(dtype)
    cos, sin = _cos_sin(B, T, D, cos_dtype, gen)
    qo, ko = ext.rope_forward(q, k, cos, sin)
    q_ref, k_ref = fwd(q.float(), k.float(), cos.float(), sin.float())
    assert qo.dtype == dtype and ko.dtype == dtype
    assert_close(qo, q_ref, **tol(dtype, 2), name="q_out")
    assert_close(ko, k_ref, **tol(dtype, 2), name="k_out")
    dq, dk = ext.rope_backward(q, k, cos, sin)
    dq_ref, dk_ref = bwd(q.float(), k.float(), cos.float(), sin.float())
    assert_close(dq, dq_ref, **tol(dtype, 2), name="dq")
    assert_close(dk, dk_ref, **tol(dtype, 2), name="dk")


def test_rope_backward_is_autograd_adjoint(ext):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 10, generator=gen, requires_grad=True)
    k = torch.randn(2, 1, 3, 10, generator=gen, requires_grad=True)
    cos, sin = (t + 0.3 for t in _cos_sin(2, 3, 10, torch.float32, gen))  # not a pure rotation
    qo, ko = rope_reference(q, k, cos, sin)  # autograd math
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    dq_ref, dk_ref = torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), (q, k))
    dq, dk = ext.rope_backward(gq, gk, cos, sin)
    assert_close(dq, dq_ref, **FP32_TOL, name="dq")
    assert_close(dk, dk_ref, **FP32_TOL, name="dk")


def test_rope_rejects_odd_head_dim(ext):
    q = torch.randn(1, 1, 2, 5)
    with pytest.raises(RuntimeError, match="even"):
        ext.rope_forward(q, q, torch.ones(1, 2, 5), torch.zeros(1, 2, 5))


# ---- cross-entropy chunk ------------------------------------------------------------------


def _ce_chunk(logits, targets, ignore_index, grad_scale):
    """The CE chunk kernel in autograd: loss per row, grad of loss_sum * grad_scale written in place."""
    x = logits.detach().clone().requires_grad_(True)
    valid = targets != ignore_index
    loss = (
        torch.nn.functional.cross_entropy(x, targets.masked_fill(~valid, 0), reduction="none")
        * valid
    )
    (grad,) = torch.autograd.grad(loss.sum() * grad_scale, x)
    return loss.detach(), grad


@pytest.mark.parametrize("n,V", [(1, 1023), (111, 129), (7, 32000)])
def test_cross_entropy_chunk(ext, n, V):
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(n, V, generator=gen) * 5
    targets = torch.randint(0, V, (n,), generator=gen)
    targets[::3] = -100
    loss_ref, grad_ref = _ce_chunk(logits, targets, -100, 0.25)
    work = logits.clone()
    loss = ext.cross_entropy_chunk_forward_backward(work, targets, -100, 0.25)
    assert_close(loss, loss_ref, **tol(torch.float32, 10), name="loss")  # lse of O(20) values
    assert_close(work, grad_ref, **FP32_TOL, name="grad (in place)")
    assert bool((work[::3] == 0).all()) and bool((loss[::3] == 0).all())


def test_cross_entropy_chunk_rejects_bad_targets(ext):
    logits = torch.randn(3, 10)
    before = logits.clone()
    for bad in (10, -1):
        with pytest.raises(ValueError, match="target"):  # as the torch path raises
            ext.cross_entropy_chunk_forward_backward(logits, torch.tensor([1, bad, 2]), -100, 1.0)
    assert torch.equal(logits, before)  # validated before any row is overwritten
    with pytest.raises(RuntimeError, match="fp32"):
        ext.cross_entropy_chunk_forward_backward(
            logits.double(), torch.tensor([1, 2, 3]), -100, 1.0
        )


def test_float64_storage_matches_the_fp32_math_contract(ext):
    """The references upcast float64 to fp32 math too, so `auto` on a float64 model agrees."""
    gen = torch.Generator().manual_seed(1)
    x, g = (torch.randn(5, 37, generator=gen, dtype=torch.float64) for _ in range(2))
    w = torch.randn(37, generator=gen, dtype=torch.float64)
    y, rstd = ext.rms_norm_forward(x, w, 1e-6)
    y_ref, rstd_ref = reference("rms_norm", "_torch_forward")(x, w, 1e-6)
    assert y.dtype == torch.float64
    assert_close(y, y_ref, **FP32_TOL, name="rms_norm y")
    h = ext.swiglu_forward(x, g)
    assert h.dtype == torch.float64
    assert_close(h, reference("swiglu", "_torch_forward")(x, g), **FP32_TOL, name="h")
    q = torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64)
    cos, sin = _cos_sin(1, 3, 8, torch.float32, gen)
    qo, _ = ext.rope_forward(q, q, cos, sin)
    assert qo.dtype == torch.float64
    assert_close(
        qo, reference("rope", "_torch_forward")(q, q, cos, sin)[0], **FP32_TOL, name="rope q"
    )


# ---- profiler ranges ----------------------------------------------------------------------


def test_kernels_are_named_ranges_in_the_profiler(ext):
    """Each kernel entry point is a torch.profiler range named ``lorafuse::<kernel>``
    (``LORAFUSE_PROFILE_RANGE``, csrc/common.h), so ``lorafuse bench --profile`` splits an autograd
    Function's time by kernel."""
    from torch.profiler import profile

    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(16, 32, generator=gen), torch.randn(16, 24, generator=gen)
    w, A, B = (
        torch.randn(24, 32, generator=gen),
        torch.randn(4, 32, generator=gen),
        torch.zeros(24, 4),
    )
    calls = {
        "swiglu_forward": lambda: ext.swiglu_forward(x, x),
        "swiglu_backward": lambda: ext.swiglu_backward(x, x, x),
        "rms_norm_forward": lambda: ext.rms_norm_forward(x, torch.ones(32), 1e-6),
        "lora_rank_up_add_": lambda: ext.lora_rank_up_add_(
            g.clone(), x[:, :4].contiguous(), B, 1.0
        ),
        "lora_linear_forward": lambda: ext.lora_linear_forward(x, w, None, A, B, 1.0, None, 1.0),
    }
    with profile() as prof:
        for call in calls.values():
            call()
    names = {e.name for e in prof.events()}
    assert {f"lorafuse::{name}" for name in calls} <= names, sorted(names)
