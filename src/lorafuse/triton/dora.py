"""Triton steps of the fused DoRA linear (:mod:`lorafuse.ops.dora`) beside the LoRA projection
(``triton/lora_linear.py``): the weight norm and the two elementwise passes over (N, k).

Contract: ``lorafuse.ops.dora._torch_weight_norm`` (here without row chunks or a κ test, see
below), ``lorafuse.ops.dora_passes.torch_scale_rows`` and ``torch_grads``.
Shapes: W (k, d), A (r, d), B (k, r), h and g (N, k), scale = m/n and norm (k,).

* ``_norm_kernel``: ``n_j = ||W_j + s·(B·A)_j||`` for a block of rows per program. Each
  (BLOCK_J, BLOCK_D) tile of ``B·A`` is a ``tl.dot`` in registers added to W's tile and squared
  into an fp32 row sum: the materialised norm (no cancellation to guard against, as the expanded
  sum of the torch path has), without the (k, d) sum ever in memory.
* ``_scale_rows_kernel``: ``y = (m/n)·h + b`` in fp32, stored in h's dtype.
* ``_grads_kernel``: ``gm = g·(m/n)`` stored in g's dtype, and per (row block, column block)
  the partial ``Σ g·h`` over the block's rows into an fp32 (row blocks, k) buffer, summed by
  torch: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafuse.triton._common import (
    cast_to,
    check_contiguous,
    check_device,
    dot_acc,
    dot_precision,
    fsum,
    interpreted,
    pow2_at_least,
)


@triton.jit
def _norm_kernel(
    W, A, B, OUT, K, D, R, swk, swd, sar, sad, sbk, sbr, scaling,
    BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """OUT[j] = ||W[j, :] + scaling·B[j, :]·A||, BLOCK_J rows per program, fp32."""
    rj = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    rr = tl.arange(0, BLOCK_R)
    row_ok = rj < K
    b = tl.load(B + rj[:, None] * sbk + rr[None, :] * sbr,
                mask=row_ok[:, None] & (rr[None, :] < R), other=0.0).to(tl.float32)  # fmt: skip
    acc = tl.full((BLOCK_J,), 0.0, tl.float32)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        col_ok = rd < D
        a = tl.load(A + rr[:, None] * sar + rd[None, :] * sad,
                    mask=(rr[:, None] < R) & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(W + rj[:, None] * swk + rd[None, :] * swd,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        ba = dot_acc(b, a, tl.full((BLOCK_J, BLOCK_D), 0.0, tl.float32), PREC)  # (B·A) tile
        v = w + scaling * ba
        acc += fsum(v * v, 1)
    tl.store(OUT + rj, tl.sqrt(acc), mask=row_ok)


@triton.jit
def _scale_rows_kernel(
    H, SCALE, BIAS, Y, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    h = tl.load(H + offs, mask=ok, other=0.0).to(tl.float32)
    y = h * tl.load(SCALE + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, cast_to(y, Y.dtype.element_ty), mask=ok)


@triton.jit
def _grads_kernel(
    G, H, SCALE, GM, PART, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NEED_DM: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(SCALE + rn, mask=rn < N, other=0.0)
    tl.store(GM + offs, cast_to(g * scale[None, :], GM.dtype.element_ty), mask=ok)
    if NEED_DM:
        h = tl.load(H + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(PART + tl.program_id(0) * N + rn, fsum(g * h, 0), mask=rn < N)


def _blocks(device, M, N):
    if interpreted(device):  # few, large programs: the interpreter's cost is per program
        return min(64, pow2_at_least(M)), min(64, pow2_at_least(N))
    return 32, 128


def weight_norm(W, A, B, scaling: float, dtype: torch.dtype):
    """``||W_j + s·(B·A)_j||`` (k,) in fp32; ``dtype`` is the op's norm dtype (fp32 only here)."""
    device = check_device("dora_linear", W, A, B)
    if dtype != torch.float32:
        raise ValueError(
            f"lorafuse.triton.dora: the weight norm runs in fp32, got {dtype} adapters"
        )
    K, D = W.shape
    R = A.shape[0]
    out = torch.empty(K, dtype=torch.float32, device=device)
    bj = 32 if not interpreted(device) else min(64, pow2_at_least(K))
    bd = 64 if not interpreted(device) else min(128, pow2_at_least(D))
    _norm_kernel[(triton.cdiv(K, bj),)](
        W, A, B, out, K, D, R, W.stride(0), W.stride(1), A.stride(0), A.stride(1),
        B.stride(0), B.stride(1), float(scaling), BLOCK_J=bj, BLOCK_D=bd,
        BLOCK_R=pow2_at_least(R), PREC=dot_precision(torch.float32), num_warps=4,
    )  # fmt: skip
    return out


def scale_rows(h, scale, bias):
    """``(m/n)·h + b`` (N, k) in h's dtype."""
    device = check_device("dora_linear", h, scale, bias)
    check_contiguous("dora_linear", h=h, scale=scale, bias=bias)
    M, N = h.shape
    y = torch.empty_like(h)
    if h.numel():
        bm, bn = _blocks(device, M, N)
        _scale_rows_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            h, scale.float(), bias if bias is not None else h, y, M, N,
            BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=bias is not None, num_warps=4,
        )  # fmt: skip
    return y


def grads(g, h, scale, need_ds: bool):
    """``(gm, ds)``: gm = g·(m/n) (N, k) in g's dtype, ds = Σ_tokens g·h (k,) fp32 or None."""
    device = check_device("dora_linear", g, h, scale)
    check_contiguous("dora_linear", g=g, h=h)
    M, N = g.shape
    gm = torch.empty_like(g)
    bm, bn = _blocks(device, M, N)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    part = torch.zeros(grid[0] if need_ds else 1, N, dtype=torch.float32, device=device)
    if g.numel():
        _grads_kernel[grid](g, h, scale.float(), gm, part, M, N, BLOCK_M=bm, BLOCK_N=bn,
                            NEED_DM=need_ds, num_warps=4)  # fmt: skip
    return gm, (part.sum(0) if need_ds else None)
