"""One LoRA projection and the path that runs its two parts apart.

:func:`split_forward` / :func:`split_backward` compute the frozen product ``x·Wᵀ (+ b)`` and the
LoRA term ``s·(dropout(x)·Aᵀ)·Bᵀ`` apart, for one or more projections of one input x: stacked
rank-r products for a shared input (:func:`~lorafuse.ops.lora_projection.stackable`), and a
quantized W dequantized tile by tile (:func:`~lorafuse.ops.weights.tiled`). Shapes: x (N, d),
weight (k, d), bias (k,), lora_A (r, d), lora_B (k, r), dropout masks (N, d) bool. Why and the
sizes: docs/kernels.md.
"""

from __future__ import annotations

import torch

from lorafuse import hardware
from lorafuse.ops.lora_rank import masked, rank_ops
from lorafuse.ops.weights import frozen_input_grad, frozen_linear


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
            xas[i] = masked(xc, m, _keep(p)) @ A.t() if ca == cx else rank.down(x, A, m, _keep(p))
    return xas


def split_forward(x, params, masks=None, *, backend: str):
    """Forward of projections of one input ``x`` (N, d), each frozen product apart from the
    LoRA products (docs/kernels.md). ``masks[i]``: projection i's dropout keep-mask (N, d)
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
    need_dB, need_db) (:func:`~lorafuse.ops.lora_projection.input_needs`). A low-precision adapter
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
                dx.add_(masked(gBs[i].to(ca) @ A, m, _keep(p)))
            else:
                rank.dx_add_(dx, gBs[i], A, m, _keep(p))
