"""One projection of a fused block (Q/K/V or gate/up/down) as the fused ops take it.

:class:`LoRAParams` bundles a base linear layer and its optional LoRA adapter. The helpers here
run one projection forward/backward through a backend's ``lora_linear`` kernels, or as a plain
frozen linear when the projection carries no adapter, so :mod:`lorafuse.ops.lora_mlp` and
:mod:`lorafuse.ops.lora_qkv` share one code path per projection. They also share how three
projections travel through an ``autograd.Function`` (:func:`flatten` / :func:`unflatten` and the
gradients back, :func:`input_needs` / :func:`input_grads`), what is saved for backward
(:func:`save_groups` / :func:`saved_groups`: named groups, no index arithmetic) and the casts
autocast asks for (:func:`cast_params`), and the path for projections that share their input
with their rank-r A products stacked (:func:`stackable`, :func:`stacked_forward`,
:func:`stacked_backward`).

Shapes: x (N, d), weight (k, d) dense or quantized (see :mod:`lorafuse.ops.weights`), bias (k,),
lora_A (r, d), lora_B (k, r).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from lorafuse import backends, hardware
from lorafuse.ops import autocast
from lorafuse.ops.lora_linear import via_custom_op as lora_linear_via_custom_op
from lorafuse.ops.weights import is_quantized, materialize

# The autograd inputs per projection, after x: (weight, bias, lora_A, lora_B).
_PER_PROJECTION = 4


class LoRAParams(NamedTuple):
    """A base linear ``weight``/``bias`` plus an optional LoRA adapter.

    ``lora_A``/``lora_B`` both None means "no LoRA on this projection": a plain frozen linear.
    ``weight`` may be a quantized weight object (``.shape`` and ``.dequantize(dtype)``).
    ``dropout_p`` is the adapter's ``lora_dropout`` (applied only when the op runs with
    ``training=True``).
    """

    weight: Any
    bias: torch.Tensor | None = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    scaling: float = 1.0
    dropout_p: float = 0.0

    @property
    def has_lora(self) -> bool:
        return self.lora_A is not None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


def check_params(p: LoRAParams, d: int, dtype: torch.dtype, name: str) -> None:
    """Validate one projection that reads inputs of width ``d`` and dtype ``dtype``."""
    if not isinstance(p, LoRAParams):
        raise TypeError(f"{name}: expected LoRAParams, got {type(p).__name__}")
    w = p.weight
    if len(w.shape) != 2 or w.shape[1] != d:
        raise ValueError(
            f"{name}.weight must be (out, {d}) for input (..., {d}), got {tuple(w.shape)}"
        )
    if not is_quantized(w):
        if w.dtype != dtype:
            raise ValueError(f"{name}.weight dtype {w.dtype} does not match input dtype {dtype}")
        if w.requires_grad and torch.is_grad_enabled():
            # The fused kernels compute no base-weight gradient; refusing beats freezing silently.
            raise ValueError(
                f"{name}.weight requires grad, but the fused LoRA ops treat base weights as frozen; "
                "freeze it (weight.requires_grad_(False)) or run the module unfused"
            )
    k = w.shape[0]
    if p.bias is not None and tuple(p.bias.shape) != (k,):
        raise ValueError(f"{name}.bias must be ({k},), got {tuple(p.bias.shape)}")
    if (p.lora_A is None) != (p.lora_B is None):
        raise ValueError(f"{name}: lora_A and lora_B must both be given or both be None")
    if p.lora_A is None:
        return
    A, B = p.lora_A, p.lora_B
    if A.dim() != 2 or A.shape[1] != d:
        raise ValueError(f"{name}.lora_A must be (r, {d}), got {tuple(A.shape)}")
    if B.dim() != 2 or tuple(B.shape) != (k, A.shape[0]):
        raise ValueError(f"{name}.lora_B must be ({k}, {A.shape[0]}), got {tuple(B.shape)}")
    if A.dtype != B.dtype:
        raise ValueError(f"{name}: lora_A ({A.dtype}) and lora_B ({B.dtype}) dtypes differ")
    if not 0.0 <= p.dropout_p < 1.0:
        raise ValueError(f"{name}.dropout_p must be in [0, 1), got {p.dropout_p}")


def draw_mask(shape, lora_A: torch.Tensor | None, p: float, device) -> torch.Tensor | None:
    """A dropout keep-mask drawn exactly as ``nn.Dropout`` draws it on the adapter-dtype input.

    Returns None when there is no adapter or no dropout, i.e. when PEFT would draw nothing
    (``lora_dropout=0`` is an ``nn.Identity``), so the RNG stream stays in step with stock PEFT.
    """
    if lora_A is None or p <= 0.0:
        return None
    return torch.empty(shape, dtype=lora_A.dtype, device=device).bernoulli_(1.0 - p).bool()


def project_forward(fwd, x, dense, p: LoRAParams, mask):
    """One projection forward: ``(y (N, k) in x's dtype, xa (N, r) or None)``."""
    if not p.has_lora:
        return F.linear(x, dense, p.bias), None
    keep = 1.0 - p.dropout_p if mask is not None else 1.0
    return fwd(x, dense, p.bias, p.lora_A, p.lora_B, float(p.scaling), mask, keep)


def project_custom_op(x, p: LoRAParams, backend: str) -> torch.Tensor:
    """One projection under torch.compile: the ``lorafuse::lora_linear`` custom op (its own
    dropout draw first, as :func:`draw_mask`), or a plain frozen linear; (N, k) in x's dtype."""
    if not p.has_lora:
        return F.linear(x, materialize(p.weight, x.dtype), p.bias)
    return lora_linear_via_custom_op(
        x, p.weight, p.bias, p.lora_A, p.lora_B, p.scaling, p.dropout_p, backend
    )


def project_backward(bwd, g, x, dense, p: LoRAParams, xa, mask, needs):
    """One projection backward: ``(dx, dA, dB, db)``, each None unless asked for in ``needs``.

    ``needs`` = (need_dx, need_dA, need_dB, need_db), the lora_linear contract order.
    """
    need_dx, need_dA, need_dB, need_db = needs
    if not p.has_lora:
        dx = (g @ dense) if need_dx else None  # (N, d)
        db = g.sum(0, dtype=torch.float32).to(g.dtype) if need_db else None
        return dx, None, None, db
    if not any(needs):
        return None, None, None, None
    keep = 1.0 - p.dropout_p if mask is not None else 1.0
    return bwd(g, x, dense, p.lora_A, p.lora_B, xa, float(p.scaling), mask, keep, tuple(needs))


# --------------------------------------------------------------------------------------------
# Projections that share an input (q/k/v; gate/up): the rank-r A products stacked.
#
# Per projection, ``x·A_iᵀ`` (N, r) reads all of x (N, d) for r columns of output, and with an
# adapter dtype other than x's (PEFT's fp32 adapters on a bf16 base) casts x first; backward reads
# (and casts) x again for ``dA_i`` and adds one more (N, d) term per projection into dx. Stacked:
# ``xa = x·[A_q; A_k; A_v]ᵀ`` (N, R) once, ``dx += gB·[A_q; A_k; A_v]`` once and
# ``d[A_q; A_k; A_v] = gBᵀ·x`` once, R = sum of the ranks. The concatenated A is a copy of R·d
# elements per call (R = 48, d = 576: 27.6K, against x's N·d = 1.2M at N = 2048). The frozen
# products stay per projection: concatenating frozen weights would duplicate weight memory.


def stackable(params, backend: str) -> bool:
    """Whether :func:`stacked_forward` / :func:`stacked_backward` serve ``params`` (projections
    of one input): at least two adapters, one adapter dtype, no dropout (with dropout each
    projection draws its own mask on x, so there is no shared input), a torch or C++ backend
    (the Triton kernels keep one launch per projection; stacking there is not measured)."""
    lora = [p for p in params if p.has_lora]
    return (
        backend in ("torch", "cpp")
        and len(lora) >= 2
        and all(p.dropout_p == 0.0 for p in lora)
        and len({p.lora_A.dtype for p in lora}) == 1
    )


def _rank_slices(params) -> list[slice | None]:
    """Each projection's columns of the stacked rank dimension (None: no adapter)."""
    out, off = [], 0
    for p in params:
        if not p.has_lora:
            out.append(None)
            continue
        r = p.lora_A.shape[0]
        out.append(slice(off, off + r))
        off += r
    return out


def _dtypes(x, params):
    """``(cx, ca, at)``: base product dtype, LoRA product dtype, adapter dtype; as the C++
    kernel picks them (``hardware.matmul_dtype``: fp32 where bf16/fp16 GEMMs are emulated)."""
    at = next(p.lora_A.dtype for p in params if p.has_lora)
    return hardware.matmul_dtype(x.device, x.dtype), hardware.matmul_dtype(x.device, at), at


class RankOps(NamedTuple):
    """The rank-r products of the stacked path between a large operand (x (N, d) or g (N, k), in
    its own dtype) and small ones in the rank dtype (A (R, d), B (k, r), xa (N, r), gB (N, R)).

    ``down(x, A) -> x·Aᵀ`` (N, R); ``up_add_(y, xa, B, s)``: ``y += s·xa·Bᵀ`` in place, one
    rounding into y's dtype; ``grads(g, B, xa, s, need_gB, need_dB) -> (s·g·B, s·gᵀ·xa)``
    (None where not asked); ``dA(gB, x) -> gBᵀ·x`` (R, d); ``dx_add_(dx, gB, A)``: ``dx +=
    gB·A`` in place, one rounding.
    """

    down: Any
    up_add_: Any
    grads: Any
    dA: Any
    dx_add_: Any


def _torch_grads(g, B, xa, s, need_gB, need_dB):
    gr = g.to(B.dtype)  # (N, k)
    gB = (gr @ B).mul_(s) if need_gB else None  # (N, r)
    dB = (gr.t() @ xa).mul_(s) if need_dB else None  # (k, r)
    return gB, dB


# The reference: plain tensor expressions. With fp32 adapters on a bf16 base they form (N, d) and
# (N, k) fp32 tensors (x and g cast, xa·Bᵀ and gB·A before they are added).
TORCH_RANK_OPS = RankOps(
    down=lambda x, A: x.to(A.dtype) @ A.t(),
    up_add_=lambda y, xa, B, s: y.add_(xa @ B.t(), alpha=s),
    grads=_torch_grads,
    dA=lambda gB, x: gB.t() @ x.to(gB.dtype),
    dx_add_=lambda dx, gB, A: dx.add_(gB.to(A.dtype) @ A),
)


def _cpp_rank_ops() -> RankOps:
    """``csrc/lora_rank.cpp``: the same fp32 products in one pass over the large operand
    (register-blocked FMA kernels converting it in registers; fp32 row tiles in cache for r past
    two vectors), so no (N, d) or (N, k) fp32 tensor is formed; where bf16 products are several
    times faster than fp32 FMA (AMX), x·Aᵀ, g·B, gᵀ·xa and gBᵀ·x of a bf16 operand as "bf16x3"
    GEMMs (the fp32 operand split into three bf16 parts, exact to fp32). Session 9's FMA kernels
    against the tiles: lora_rank.cpp's comments. Before them, ``benchmarks/bench_lora_rank.py
    --threads 1 --cpu-time`` (N = 2048, r = 16, bf16 base, fp32 adapters, AMX Xeon at load ~3;
    torch/cpp time, tiles only): SmolLM2-135M up_add_ 3.38x, dx_add_ 3.95x, grads 1.52x, down
    1.38x, dA 1.39x; the fused MLP fwd+bwd with gate/up stacked 1.43x, Q/K/V 1.41x; llama-4l-1024
    MLP 1.36x, Q/K/V 1.69x. bf16x3 against the tiles (``--baseline tiles``, load 2.3-3.8): down
    1.5-1.6x, grads 1.35-1.46x, dA 1.0-1.4x; a whole SmolLM2 bf16 step ~8% faster."""
    down, up_add_, grads, dA, dx_add_ = backends.compiled(
        "lora_rank", "cpp", "down", "up_add_", "grads", "dA", "dx_add_"
    )
    return RankOps(
        down=lambda x, A: down(x, A, None, 1.0),
        up_add_=lambda y, xa, B, s: up_add_(y, xa, B, float(s)),
        grads=lambda g, B, xa, s, need_gB, need_dB: tuple(
            t if need else None
            for t, need in zip(grads(g, B, xa, float(s), need_gB, need_dB), (need_gB, need_dB))
        ),
        dA=lambda gB, x: dA(gB, x, None, 1.0),
        dx_add_=lambda dx, gB, A: dx_add_(dx, gB, A, None, 1.0),
    )


def cpp_rank_bf16x3() -> bool:
    """Whether the C++ rank-r products take bf16x3 for a bf16 large operand on this machine (AMX:
    bf16 products native, torch's oneDNN packs bf16 and MKL's bf16 GEMM found; ``use_bf16x3`` in
    ``csrc/lora_rank_bf16x3.cpp`` says why only there), else the FMA kernels or fp32 tiles."""
    from lorafuse import _ext

    return bool(_ext.load_cpp().lora_rank_bf16x3_active())


def rank_ops(backend: str, rank_dtype: torch.dtype, out_dtype: torch.dtype) -> RankOps:
    """The rank-r products for ``backend``: the C++ ones where they apply (``cpp``, products in
    fp32, outputs added into fp32/bf16/fp16), else :data:`TORCH_RANK_OPS`."""
    lowp = (torch.float32, torch.bfloat16, torch.float16)
    if backend == "cpp" and rank_dtype == torch.float32 and out_dtype in lowp:
        return _cpp_rank_ops()
    return TORCH_RANK_OPS


def stacked_forward(x, params, *, backend: str):
    """Forward of projections sharing ``x`` (N, d) with one stacked A product.

    Quantized base weights are dequantized one projection at a time. Returns ``(ys, xas)``:
    ys[i] (N, k_i) in x's dtype; xas[i] (N, r_i) in the adapter dtype, a column view of the one
    stacked ``xa`` (N, R), or None for a projection without adapter. Caller checks
    :func:`stackable`. ``backend`` picks the rank-r products (:func:`rank_ops`).
    """
    cx, ca, at = _dtypes(x, params)
    rank = rank_ops(backend, ca, cx)
    xc = x.to(cx)  # (N, d); x itself unless the base product is upcast
    A = torch.cat([p.lora_A for p in params if p.has_lora]).to(ca)  # (R, d): R·d copy
    xa = xc @ A.t() if ca == cx else rank.down(x, A)  # (N, R): x read (and cast) once
    ys = []
    for p, sl in zip(params, _rank_slices(params)):
        wt = materialize(p.weight, x.dtype).to(cx).t()  # (d, k_i) view; transient if quantized
        y = xc @ wt if p.bias is None else torch.addmm(p.bias.to(cx), xc, wt)  # (N, k_i)
        if sl is not None:
            B = p.lora_B.to(ca)  # (k_i, r_i)
            if ca == cx:
                y.addmm_(xa[:, sl], B.t(), alpha=float(p.scaling))  # LoRA term added in place
            else:
                rank.up_add_(y, xa[:, sl], B, float(p.scaling))  # y += s·xa_i·B_iᵀ, one rounding
        ys.append(y.to(x.dtype))
        del wt  # before the next projection's dequantized copy exists
    xa = xa.to(at)  # (N, R)
    return ys, [None if sl is None else xa[:, sl] for sl in _rank_slices(params)]


def stacked_backward(grads, x, params, xas, need_dx: bool, wants, *, backend: str):
    """Backward of :func:`stacked_forward`: ``(dx, [(db, dA, dB) per projection])``.

    ``grads[i]`` (N, k_i); ``xas`` as forward returned them; ``wants[i]`` = (need_dA, need_dB,
    need_db) (:func:`input_needs`). A low-precision adapter keeps the rank-r products gB, dA, dB
    in fp32 and rounds each result once, as ``csrc/lora_linear.cpp`` does (dA sums N terms that
    can cancel; a bf16-rounded gB costs ~30x the result's own rounding there). ``backend`` picks
    the rank-r products (:func:`rank_ops`).
    """
    cx, ca, at = _dtypes(x, params)
    cr = torch.float32 if ca in (torch.bfloat16, torch.float16) else ca
    rank = rank_ops(backend, cr, cx)
    slices = _rank_slices(params)
    need_dA = any(w[0] for w, sl in zip(wants, slices) if sl is not None)
    gBs, out = [], []
    for p, g, xa, sl, (_, want_dB, want_db) in zip(params, grads, xas, slices, wants):
        db = g.sum(0, dtype=torch.float32).to(g.dtype) if want_db else None  # (k_i,)
        dB = None
        if sl is not None:
            gB, dB = rank.grads(
                g, p.lora_B.to(cr), xa.to(cr), float(p.scaling), need_dx or need_dA, want_dB
            )  # (N, r_i), (k_i, r_i)
            if gB is not None:
                gBs.append(gB)
            if dB is not None:
                dB = dB.to(at)
        out.append([db, None, dB])
    gB = torch.cat(gBs, 1) if gBs else None  # (N, R)
    if need_dA:
        dA = rank.dA(gB, x).to(at)  # (R, d): x read (and cast) once for every adapter
        for o, sl, w in zip(out, slices, wants):
            if sl is not None and w[0]:
                o[1] = dA[sl]  # (r_i, d) row block, contiguous
    dx = None
    if need_dx:
        for p, g in zip(params, grads):  # frozen products, summed: (N, d)
            gw = (g.to(cx), materialize(p.weight, x.dtype).to(cx))  # one dense copy at a time
            if dx is None:
                dx = gw[0] @ gw[1]
            elif cx == torch.float32:
                dx.addmm_(*gw)  # accumulated by the GEMM, no (N, d) temporary
            else:  # a bf16 addmm_ into dx ran 5.96 ms vs 4.46 ms + 0.53 ms for mm + add_ in an
                dx.add_(gw[0] @ gw[1])  # ad-hoc probe (2048x1536 @ 1536x576, 1 thread, AMX Xeon)
            del gw  # before the next projection's dequantized copy exists
        A = torch.cat([p.lora_A for p in params if p.has_lora]).to(ca)  # (R, d)
        if ca == cx:
            dx.addmm_(gB.to(ca), A)  # every adapter's input gradient in one product
        else:  # in the adapter dtype (a bf16 adapter on an fp32 base: gB rounded, as the kernel)
            rank_ops(backend, ca, cx).dx_add_(dx, gB, A)  # every adapter's dx term, one rounding
        dx = dx.to(x.dtype)
    return dx, [tuple(o) for o in out]


def cast_params(p: LoRAParams, dtype: torch.dtype) -> LoRAParams:
    """``p`` with every tensor cast as autocast casts a linear's operands (see ops/autocast.py)."""
    return p._replace(
        weight=autocast.cast(p.weight, dtype),
        bias=autocast.cast(p.bias, dtype),
        lora_A=autocast.cast(p.lora_A, dtype),
        lora_B=autocast.cast(p.lora_B, dtype),
    )


# --------------------------------------------------------------------------------------------
# Projections through an autograd.Function: apply(x, *flatten(params), meta, ...).


def flatten(params) -> list:
    """The Function's tensor inputs after ``x``: (weight, bias, lora_A, lora_B) per projection."""
    return [t for p in params for t in (p.weight, p.bias, p.lora_A, p.lora_B)]


def meta_of(params) -> tuple:
    """The static part of each projection, passed to the Function next to :func:`flatten`."""
    return tuple((float(p.scaling), float(p.dropout_p)) for p in params)


def unflatten(tensors, meta) -> list[LoRAParams]:
    """Inverse of :func:`flatten` + :func:`meta_of`."""
    n = _PER_PROJECTION
    return [LoRAParams(*tensors[n * i : n * i + n], *m) for i, m in enumerate(meta)]


def input_needs(needs, i: int) -> tuple[bool, bool, bool]:
    """``(need_dA, need_dB, need_db)`` of projection ``i`` from ``ctx.needs_input_grad`` (x first)."""
    _, bias, lora_A, lora_B = needs[1 + _PER_PROJECTION * i : 1 + _PER_PROJECTION * (i + 1)]
    return lora_A, lora_B, bias


def input_grads(grads) -> list:
    """The gradients for :func:`flatten`'s inputs from ``(db, dA, dB)`` per projection
    (frozen weights get None)."""
    return [t for db, dA, dB in grads for t in (None, db, dA, dB)]


# --------------------------------------------------------------------------------------------
# Saved tensors by name.


def save_groups(ctx, **groups) -> None:
    """``ctx.save_for_backward`` of named tensors or sequences of tensors (None allowed)."""
    flat, layout = [], []
    for name, value in groups.items():
        many = isinstance(value, (list, tuple))
        layout.append((name, len(value) if many else None))
        flat.extend(value if many else (value,))
    ctx.save_for_backward(*flat)
    ctx.saved_layout = tuple(layout)


def saved_groups(ctx) -> SimpleNamespace:
    """What :func:`save_groups` saved, by the same names (sequences come back as tuples)."""
    it = iter(ctx.saved_tensors)
    return SimpleNamespace(**{
        name: next(it) if n is None else tuple(next(it) for _ in range(n))
        for name, n in ctx.saved_layout
    })  # fmt: skip


def save_projections(ctx, params, **extra) -> None:
    """Save ``params`` for backward: their adapters and dense weights as tensors, quantized
    weight objects and the static fields on ``ctx`` (only tensors can be saved), plus ``extra``.

    Biases are not saved: backward needs only their gradient, which is ``g.sum(0)``.
    """
    ctx.params = [
        p._replace(weight=p.weight if is_quantized(p.weight) else None, bias=None, lora_A=None,
                   lora_B=None)
        for p in params
    ]  # fmt: skip
    save_groups(
        ctx,
        weight=[None if is_quantized(p.weight) else p.weight for p in params],
        lora_A=[p.lora_A for p in params],
        lora_B=[p.lora_B for p in params],
        **extra,
    )


def saved_projections(ctx) -> tuple[list[LoRAParams], SimpleNamespace]:
    """``(params, saved)``: :func:`save_projections`' params and everything else it saved, by
    name. Quantized weights come back quantized: each backward step dequantizes its own
    projection right before its products (:func:`~lorafuse.ops.weights.materialize` into
    ``saved.x``'s dtype), so at most one dense copy is alive at a time."""
    saved = saved_groups(ctx)
    params = [
        p._replace(weight=p.weight if w is None else w, lora_A=a, lora_B=b)
        for p, w, a, b in zip(ctx.params, saved.weight, saved.lora_A, saved.lora_B)
    ]
    return params, saved
