"""Triton RMSNorm (HF Llama semantics): ``y = weight * (x·rstd).to(x.dtype)``.

Contract: ``lorafuse.ops.rms_norm._torch_forward`` / ``_torch_backward``.
Shapes: x (N, d), weight (d,), rstd (N,) fp32, g (N, d) (y's dtype).

* forward: one program per row; the whole row (d padded to a power of two) sits in registers;
  writes y (x's dtype) and rstd (fp32, saved for backward instead of recomputing the mean).
* backward: a persistent grid of a few programs per SM, each walking rows ``pid, pid+P, ...``:
  dx per row, and ``dw`` accumulated in fp32 registers per program, written as a (P, d) partial
  sum that one ``sum(0)`` reduces. No (N, d) fp32 intermediate is written.

Math: n = x·rstd; y = w·cast(n). With dn = g·w, dx = rstd·(dn − n·mean(dn·n)); dw = Σ_rows g·cast(n).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafuse.triton._common import cast_to, check_contiguous, check_device, fsum, programs_for_rows


@triton.jit
def _rms_fwd_kernel(X, W, Y, RSTD, D, sx, sy, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x = tl.load(X + row * sx + cols, mask=ok, other=0.0)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(fsum(h * h, 0) / D + eps)
    normed = cast_to(h * rstd, x.dtype).to(tl.float32)  # HF rounds to x's dtype before the weight
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, cast_to(w * normed, Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd_kernel(
    G, X, W, RSTD, DX, DW_PART, N, D, sg, sx, sdx,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.full((BLOCK_D,), 0.0, tl.float32)
    for row in range(pid, N, progs):
        r64 = tl.cast(row, tl.int64)
        x = tl.load(X + r64 * sx + cols, mask=ok, other=0.0)
        g = tl.load(G + r64 * sg + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = x.to(tl.float32) * rstd
        if NEED_DW:
            dw += g * cast_to(n, x.dtype).to(tl.float32)
        if NEED_DX:
            dn = g * w
            dx = rstd * (dn - n * (fsum(dn * n, 0) / D))
            tl.store(DX + r64 * sdx + cols, cast_to(dx, DX.dtype.element_ty), mask=ok)
    if NEED_DW:
        tl.store(DW_PART + pid * D + cols, dw, mask=ok)


def _warps(block_d: int) -> int:
    return 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16


def forward(x, weight, eps):
    """``(y (N, d) in x's dtype promoted with weight's, rstd (N,) fp32)``."""
    check_device("rms_norm", x, weight)
    check_contiguous("rms_norm", x=x, weight=weight)
    N, D = x.shape
    # weight * x-dtype tensor promotes (HF Llama, and the torch reference): bf16 x, fp32 w -> fp32 y
    y = torch.empty((N, D), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty((N,), dtype=torch.float32, device=x.device)
    if N == 0:
        return y, rstd
    block_d = triton.next_power_of_2(D)
    _rms_fwd_kernel[(N,)](
        x, weight, y, rstd, D, x.stride(0), y.stride(0), float(eps),
        BLOCK_D=block_d, num_warps=_warps(block_d),
    )  # fmt: skip
    return y, rstd


def backward(g, x, weight, rstd, needs):
    """``(dx (N, d) x's dtype | None, dw (d,) weight's dtype | None)``; fp32 accumulation."""
    need_dx, need_dw = needs
    check_device("rms_norm", g, x, weight, rstd)
    check_contiguous("rms_norm", g=g, x=x, weight=weight, rstd=rstd)
    if not (need_dx or need_dw):
        return None, None
    N, D = x.shape
    progs = programs_for_rows(x.device, N)
    dx = torch.empty_like(x) if need_dx else None
    part = torch.empty((progs, D), dtype=torch.float32, device=x.device) if need_dw else None
    if N == 0:
        return dx, (torch.zeros_like(weight) if need_dw else None)
    block_d = triton.next_power_of_2(D)
    _rms_bwd_kernel[(progs,)](
        g, x, weight, rstd, dx if dx is not None else g, part if part is not None else rstd,
        N, D, g.stride(0), x.stride(0), dx.stride(0) if dx is not None else 0,
        NEED_DX=need_dx, NEED_DW=need_dw, BLOCK_D=block_d, num_warps=_warps(block_d),
    )  # fmt: skip
    dw = part.sum(0).to(weight.dtype) if need_dw else None
    return dx, dw
