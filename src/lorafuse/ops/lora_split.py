"""One LoRA projection and the path that runs its two parts apart.

:class:`LoRAParams` bundles a base linear layer and its optional LoRA adapter. The fused
``lora_linear`` kernels compute the frozen product ``x·Wᵀ (+ b)`` and the LoRA term
``s·(dropout(x)·Aᵀ)·Bᵀ`` in one call from one dense W. :func:`split_forward` /
:func:`split_backward` run them apart, for one or more projections of one input x:

* **Shared input** (q/k/v; gate/up, :func:`~lorafuse.ops.lora_params.stackable` says when):
  per projection, ``x·A_iᵀ`` (N, r) reads all of x (N, d) for r columns of output, and with an
  adapter dtype other than x's (PEFT's fp32 adapters on a bf16 base) casts x first; backward
  reads (and casts) x again for ``dA_i`` and adds one more (N, d) term per projection into dx.
  Here the adapters without dropout are stacked: ``xa = x·[A_q; A_k; A_v]ᵀ`` (N, R) once,
  ``dx += gB·[A_q; A_k; A_v]`` once and ``d[A_q; A_k; A_v] = gBᵀ·x`` once, R = sum of the ranks.
  The concatenated A is a copy of R·d elements per call (R = 48, d = 576: 27.6K, against x's
  N·d = 1.2M at N = 2048). An adapter with dropout draws its own mask on x: its own products.
* **Quantized base weights in tiles** (:func:`~lorafuse.ops.weights.tiled`): the frozen product
  dequantizes one row tile of W at a time in forward (a block of y's columns each) and one
  column tile in backward (a block of dx's columns each), so no dense copy larger than a tile
  (:data:`~lorafuse.ops.weights.TILE_BYTES`) is alive, where the fused kernel needs the
  whole W (32 MiB for one MLP projection of Llama-3.2-1B in bf16). Each output element is the
  same dot product as with the whole W; the LoRA products are the kernel's.

The frozen products stay per projection: concatenating frozen weights would duplicate weight
memory. Shapes: x (N, d), weight (k, d) dense or quantized (see :mod:`lorafuse.ops.weights`),
bias (k,), lora_A (r, d), lora_B (k, r), dropout masks (N, d) bool.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lorafuse import backends, hardware
from lorafuse.ops.weights import frozen_input_grad, frozen_linear


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


class RankOps(NamedTuple):
    """The rank-r products of the split path between a large operand (x (N, d) or g (N, k), in
    its own dtype) and small ones in the rank dtype (A (R, d), B (k, r), xa (N, r), gB (N, R)).

    ``down(x, A, mask=None, keep=1) -> dropout(x)·Aᵀ`` (N, R); ``up_add_(y, xa, B, s)``: ``y +=
    s·xa·Bᵀ`` in place, one rounding into y's dtype; ``grads(g, B, xa, s, need_gB, need_dB) ->
    (s·g·B, s·gᵀ·xa)`` (None where not asked); ``dA(gB, x, mask=None, keep=1) ->
    gBᵀ·dropout(x)`` (R, d); ``dx_add_(dx, gB, A, mask=None, keep=1)``: ``dx += dropout(gB·A)``
    in place, one rounding. ``dropout(t)`` is ``t * mask / keep`` (no mask: t).
    """

    down: Any
    up_add_: Any
    grads: Any
    dA: Any
    dx_add_: Any


def _masked(t, mask, keep):
    """``t`` scaled as ``nn.Dropout`` scales its input, ``t * mask / keep`` (None: ``t``)."""
    return t if mask is None else t * mask.to(t.dtype).div_(keep)


def _torch_grads(g, B, xa, s, need_gB, need_dB):
    gr = g.to(B.dtype)  # (N, k)
    gB = (gr @ B).mul_(s) if need_gB else None  # (N, r)
    dB = (gr.t() @ xa).mul_(s) if need_dB else None  # (k, r)
    return gB, dB


# The reference: plain tensor expressions. With fp32 adapters on a bf16 base they form (N, d) and
# (N, k) fp32 tensors (x and g cast, xa·Bᵀ and gB·A before they are added).
TORCH_RANK_OPS = RankOps(
    down=lambda x, A, mask=None, keep=1.0: _masked(x.to(A.dtype), mask, keep) @ A.t(),
    up_add_=lambda y, xa, B, s: y.add_(xa @ B.t(), alpha=s),
    grads=_torch_grads,
    dA=lambda gB, x, mask=None, keep=1.0: gB.t() @ _masked(x.to(gB.dtype), mask, keep),
    dx_add_=lambda dx, gB, A, mask=None, keep=1.0: dx.add_(_masked(gB.to(A.dtype) @ A, mask, keep)),
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
        down=lambda x, A, mask=None, keep=1.0: down(x, A, mask, float(keep)),
        up_add_=lambda y, xa, B, s: up_add_(y, xa, B, float(s)),
        grads=lambda g, B, xa, s, need_gB, need_dB: tuple(
            t if need else None
            for t, need in zip(grads(g, B, xa, float(s), need_gB, need_dB), (need_gB, need_dB))
        ),
        dA=lambda gB, x, mask=None, keep=1.0: dA(gB, x, mask, float(keep)),
        dx_add_=lambda dx, gB, A, mask=None, keep=1.0: dx_add_(dx, gB, A, mask, float(keep)),
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


def _dtypes(x, params):
    """``(cx, ca, at)``: base product dtype, LoRA product dtype, adapter dtype; as the C++
    kernel picks them (``hardware.matmul_dtype``: fp32 where bf16/fp16 GEMMs are emulated).
    Without adapters, the adapter dtype is x's."""
    at = next((p.lora_A.dtype for p in params if p.has_lora), x.dtype)
    return hardware.matmul_dtype(x.device, x.dtype), hardware.matmul_dtype(x.device, at), at


def _shared(params, masks) -> list[int]:
    """The projections whose A products run stacked: an adapter and no dropout mask."""
    return [i for i, (p, m) in enumerate(zip(params, masks)) if p.has_lora and m is None]


def _keep(p) -> float:
    return 1.0 - p.dropout_p


def _rank_down(x, xc, params, masks, rank, ca, cx) -> list:
    """``dropout_i(x)·A_iᵀ`` (N, r_i) in ``ca`` per projection (None without adapter): the
    :func:`_shared` ones as one stacked product (x read and cast once), each masked one alone."""
    xas = [None] * len(params)
    shared = _shared(params, masks)
    if shared:
        A = torch.cat([params[i].lora_A for i in shared]).to(ca)  # (R, d): R·d copy
        xa = xc @ A.t() if ca == cx else rank.down(x, A)  # (N, R)
        off = 0
        for i in shared:
            r = params[i].lora_A.shape[0]
            xas[i], off = xa[:, off : off + r], off + r  # (N, r_i) column view
    for i, (p, m) in enumerate(zip(params, masks)):
        if p.has_lora and m is not None:
            A = p.lora_A.to(ca)  # (r_i, d)
            xas[i] = _masked(xc, m, _keep(p)) @ A.t() if ca == cx else rank.down(x, A, m, _keep(p))
    return xas


def split_forward(x, params, masks=None, *, backend: str):
    """Forward of projections of one input ``x`` (N, d), each frozen product apart from the
    LoRA products (module docstring). ``masks[i]``: projection i's dropout keep-mask (N, d)
    bool or None (default: none). Returns ``(ys, xas)``: ys[i] (N, k_i) in x's dtype; xas[i]
    (N, r_i) in the adapter dtype (a column view of the stacked product when shared), or None.
    ``backend`` picks the rank-r products (:func:`rank_ops`)."""
    masks = masks or (None,) * len(params)
    cx, ca, at = _dtypes(x, params)
    rank = rank_ops(backend, ca, cx)
    xc = x.to(cx)  # (N, d); x itself unless the base product is upcast
    xas = _rank_down(x, xc, params, masks, rank, ca, cx)
    ys = []
    for p, xa in zip(params, xas):
        y = frozen_linear(xc, p.weight, p.bias, x.dtype)  # (N, k_i); a quantized W by tiles
        if xa is not None:
            B = p.lora_B.to(ca)  # (k_i, r_i)
            if ca == cx:
                y.addmm_(xa, B.t(), alpha=float(p.scaling))  # LoRA term added in place
            else:
                rank.up_add_(y, xa, B, float(p.scaling))  # y += s·xa_i·B_iᵀ, one rounding
        ys.append(y.to(x.dtype))
    return ys, [None if xa is None else xa.to(at) for xa in xas]


def split_backward(grads, x, params, xas, need_dx: bool, wants, masks=None, *, backend: str):
    """Backward of :func:`split_forward`: ``(dx, [(db, dA, dB) per projection])``.

    ``grads[i]`` (N, k_i); ``xas`` and ``masks`` as forward had them; ``wants[i]`` = (need_dA,
    need_dB, need_db) (:func:`~lorafuse.ops.lora_params.input_needs`). A low-precision adapter
    keeps the rank-r products gB, dA, dB in fp32 and rounds each result once, as
    ``csrc/lora_linear.cpp`` does (dA sums N terms that can cancel; a bf16-rounded gB costs ~30x
    the result's own rounding there). ``backend`` picks the rank-r products (:func:`rank_ops`).
    """
    masks = masks or (None,) * len(params)
    cx, ca, at = _dtypes(x, params)
    cr = torch.float32 if ca in (torch.bfloat16, torch.float16) else ca
    rank = rank_ops(backend, cr, cx)
    need_dA = any(p.has_lora and w[0] for p, w in zip(params, wants))
    gBs, out = [None] * len(params), []
    for i, (p, g, xa, (_, want_dB, want_db)) in enumerate(zip(params, grads, xas, wants)):
        db = g.sum(0, dtype=torch.float32).to(g.dtype) if want_db else None  # (k_i,)
        dB = None
        if p.has_lora:
            gBs[i], dB = rank.grads(
                g, p.lora_B.to(cr), xa.to(cr), float(p.scaling), need_dx or need_dA, want_dB
            )  # (N, r_i), (k_i, r_i)
            if dB is not None:
                dB = dB.to(at)
        out.append([db, None, dB])
    shared = _shared(params, masks)
    if need_dA:
        if shared:  # x read (and cast) once for every shared adapter: (R, d)
            dA = rank.dA(torch.cat([gBs[i] for i in shared], 1), x).to(at)
            off = 0
            for i in shared:
                r = params[i].lora_A.shape[0]
                out[i][1], off = dA[off : off + r], off + r  # (r_i, d) row block, contiguous
        for i, (p, m) in enumerate(zip(params, masks)):
            if p.has_lora and m is not None and wants[i][0]:
                out[i][1] = rank.dA(gBs[i], x, m, _keep(p)).to(at)  # (r_i, d)
    dx = None
    if need_dx:
        for p, g in zip(params, grads):  # frozen products, summed: (N, d); a quantized W by tiles
            dx = frozen_input_grad(g.to(cx), p.weight, x.dtype, into=dx)
        _add_rank_input_grads(dx, params, masks, gBs, shared, backend, ca, cx)
        dx = dx.to(x.dtype)
    return dx, [tuple(o) for o in out]


def _add_rank_input_grads(dx, params, masks, gBs, shared, backend, ca, cx) -> None:
    """``dx += Σ_i dropout_i(gB_i·A_i)`` in place: the shared adapters in one product."""
    rank = rank_ops(backend, ca, cx)  # adapter dtype (bf16 on fp32: gB rounded, as the kernel)
    if shared:
        A = torch.cat([params[i].lora_A for i in shared]).to(ca)  # (R, d)
        gB = torch.cat([gBs[i] for i in shared], 1)  # (N, R)
        if ca == cx:
            dx.addmm_(gB.to(ca), A)  # every shared adapter's input gradient in one product
        else:
            rank.dx_add_(dx, gB, A)  # every shared adapter's dx term, one rounding
    for i, (p, m) in enumerate(zip(params, masks)):
        if p.has_lora and m is not None:
            A = p.lora_A.to(ca)
            if ca == cx:
                dx.add_(_masked(gBs[i].to(ca) @ A, m, _keep(p)))
            else:
                rank.dx_add_(dx, gBs[i], A, m, _keep(p))
