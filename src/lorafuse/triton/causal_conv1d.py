"""Triton causal depthwise conv1d with optional SiLU, per packed example, forward and backward.

Contract: ``lorafuse.ops.causal_conv1d._torch_forward`` / ``_torch_backward``. Shapes: x (B, D, T)
(run on channels adjacent in memory, as the models hand it over; another layout is copied once),
weight (D, K), bias (D,), states (N, D, K - 1). y (B, D, T) with channels adjacent in memory.

* forward: one program per (example, block of BT tokens, block of BD channels): K masked loads
  per output (positions before the example's start read its state), fp32 sums, SiLU, one
  rounding; a second small grid writes each example's last K - 1 inputs (the final state).
* backward: the same grid recomputes the pre-activation at the K positions each input feeds,
  dx[p] = Σ_m w[K-1-m]·dz[p+m] (plus the final state's gradient), and writes per-program partial
  sums of dweight and dbias (summed by one torch reduction); a small grid gives the state's
  gradient. Math fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafuse.triton._common import cast_to, check_device, fsum, sigmoid

BT, BD = 32, 64


@triton.jit
def _x_tilde(X, S, n, row, bos, eos, p, c, ok_c, sxb, sxt, D, K: tl.constexpr,
             HAS_S: tl.constexpr):  # fmt: skip
    """x̃[p, c] of example n (fp32): x at bos <= p < eos, its state before (zero without one),
    zero past the example (a block's tail past the row's end is never read: an unmasked read
    there can be NaN, and 0 x NaN reaches the gradient sums)."""
    inside = p >= bos
    xv = tl.load(X + row * sxb + p[:, None] * sxt + c[None, :],
                 mask=(inside & (p < eos))[:, None] & ok_c[None, :], other=0.0).to(tl.float32)  # fmt: skip
    if HAS_S:
        j = K - 1 - (bos - p)  # the state's column
        sv = tl.load(S + (n * D + c[None, :]) * (K - 1) + j[:, None],
                     mask=(~inside & (j >= 0))[:, None] & ok_c[None, :], other=0.0)  # fmt: skip
        xv += sv.to(tl.float32)
    return xv


@triton.jit
def _preact(X, W, BIAS, S, n, row, bos, eos, t, c, ok_c, sxb, sxt, D,
            K: tl.constexpr, HAS_B: tl.constexpr, HAS_S: tl.constexpr):  # fmt: skip
    z = tl.full((t.shape[0], c.shape[0]), 0.0, tl.float32)
    if HAS_B:
        z += tl.load(BIAS + c, mask=ok_c, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        w = tl.load(W + c * K + j, mask=ok_c, other=0.0).to(tl.float32)
        z += w[None, :] * _x_tilde(
            X, S, n, row, bos, eos, t - (K - 1) + j, c, ok_c, sxb, sxt, D, K, HAS_S
        )
    return z


@triton.jit
def _fwd_kernel(X, W, BIAS, S, START, END, ROWS, Y, sxb, sxt, T, D, K: tl.constexpr, HAS_B: tl.constexpr,
                HAS_S: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    n, it, ic = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(START + n).to(tl.int64), tl.load(END + n).to(tl.int64)
    row = tl.load(ROWS + n).to(tl.int64)
    t = bos + it * BT + tl.arange(0, BT)
    c = ic * BD + tl.arange(0, BD)
    ok_t, ok_c = t < eos, c < D
    z = _preact(X, W, BIAS, S, n, row, bos, eos, t, c, ok_c, sxb, sxt, D, K, HAS_B, HAS_S)
    y = z * sigmoid(z) if SILU else z
    tl.store(Y + (row * T + t[:, None]) * D + c[None, :], cast_to(y, Y.dtype.element_ty),
             mask=ok_t[:, None] & ok_c[None, :])  # fmt: skip


@triton.jit
def _final_kernel(X, S, START, END, ROWS, F, sxb, sxt, D, K: tl.constexpr, HAS_S: tl.constexpr,
                  KP: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    n, ic = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(START + n).to(tl.int64), tl.load(END + n).to(tl.int64)
    row = tl.load(ROWS + n).to(tl.int64)
    c = ic * BD + tl.arange(0, BD)
    i = tl.arange(0, KP)  # the state's columns, K - 1 of them
    ok_c = c < D
    xv = _x_tilde(X, S, n, row, bos, eos, eos - (K - 1) + i, c, ok_c, sxb, sxt, D, K, HAS_S)
    tl.store(F + (n * D + c[None, :]) * (K - 1) + i[:, None], cast_to(xv, F.dtype.element_ty),
             mask=(i < K - 1)[:, None] & ok_c[None, :])  # fmt: skip


@triton.jit
def _dz(X, W, BIAS, S, DY, n, row, bos, eos, t, c, ok_c, sxb, sxt, sdb, sdt, D,
        K: tl.constexpr, HAS_B: tl.constexpr, HAS_S: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
    """The pre-activation's gradient at tokens t (zero outside [bos, eos))."""
    ok = (t >= bos) & (t < eos)
    dz = tl.load(DY + row * sdb + t[:, None] * sdt + c[None, :], mask=ok[:, None] & ok_c[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    if SILU:  # d silu(z)/dz = s·(1 + z·(1 - s))
        z = _preact(X, W, BIAS, S, n, row, bos, eos, t, c, ok_c, sxb, sxt, D, K, HAS_B, HAS_S)
        s = sigmoid(z)
        dz = dz * s * (1.0 + z * (1.0 - s))
    return dz


@triton.jit
def _bwd_kernel(X, W, BIAS, S, START, END, ROWS, DY, DFIN, DX, DWP, sxb, sxt, sdb, sdt, T, D, NT,
                K: tl.constexpr, HAS_B: tl.constexpr, HAS_S: tl.constexpr, HAS_F: tl.constexpr,
                SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    n, it, ic = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(START + n).to(tl.int64), tl.load(END + n).to(tl.int64)
    row = tl.load(ROWS + n).to(tl.int64)
    t = bos + it * BT + tl.arange(0, BT)
    c = ic * BD + tl.arange(0, BD)
    ok_t, ok_c = t < eos, c < D
    part = (n * NT + it) * (K + 1) * D + c  # this program's partial-sum rows
    dz = _dz(X, W, BIAS, S, DY, n, row, bos, eos, t, c, ok_c, sxb, sxt, sdb, sdt, D, K, HAS_B,
             HAS_S, SILU)  # fmt: skip
    for j in tl.static_range(K):  # dweight[c, j] = Σ_t dz[t]·x̃[t - K + 1 + j]
        xv = _x_tilde(X, S, n, row, bos, eos, t - (K - 1) + j, c, ok_c, sxb, sxt, D, K, HAS_S)
        tl.store(DWP + part + j * D, fsum(dz * xv, 0), mask=ok_c)
    tl.store(DWP + part + K * D, fsum(dz, 0), mask=ok_c)  # dbias
    dx = tl.full((BT, BD), 0.0, tl.float32)
    for m in tl.static_range(K):  # dx[p] = Σ_m w[K-1-m]·dz[p + m]
        w = tl.load(W + c * K + (K - 1 - m), mask=ok_c, other=0.0).to(tl.float32)
        dx += w[None, :] * _dz(X, W, BIAS, S, DY, n, row, bos, eos, t + m, c, ok_c, sxb, sxt, sdb,
                               sdt, D, K, HAS_B, HAS_S, SILU)  # fmt: skip
    if HAS_F:  # the final state's gradient: x̃[eos - K + 1 + i] += dfinal[i]
        i = t - (eos - (K - 1))
        dx += tl.load(DFIN + (n * D + c[None, :]) * (K - 1) + i[:, None],
                      mask=((i >= 0) & ok_t)[:, None] & ok_c[None, :], other=0.0).to(tl.float32)  # fmt: skip
    tl.store(DX + (row * T + t[:, None]) * D + c[None, :], cast_to(dx, DX.dtype.element_ty),
             mask=ok_t[:, None] & ok_c[None, :])  # fmt: skip


@triton.jit
def _dstate_kernel(X, W, BIAS, S, START, END, ROWS, DY, DFIN, DH, sxb, sxt, sdb, sdt, D,
                   K: tl.constexpr, HAS_B: tl.constexpr, HAS_F: tl.constexpr, SILU: tl.constexpr,
                   KP: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    n, ic = tl.program_id(0), tl.program_id(1)
    bos, eos = tl.load(START + n).to(tl.int64), tl.load(END + n).to(tl.int64)
    row = tl.load(ROWS + n).to(tl.int64)
    c = ic * BD + tl.arange(0, BD)
    i = tl.arange(0, KP)
    ok_c, ok_i = c < D, i < K - 1
    p = bos - (K - 1) + i  # the state's positions, before the example
    acc = tl.full((KP, BD), 0.0, tl.float32)
    for m in tl.static_range(K):
        w = tl.load(W + c * K + (K - 1 - m), mask=ok_c, other=0.0).to(tl.float32)
        acc += w[None, :] * _dz(X, W, BIAS, S, DY, n, row, bos, eos, p + m, c, ok_c, sxb, sxt,
                                sdb, sdt, D, K, HAS_B, True, SILU)  # fmt: skip
    if HAS_F:  # a short example's state reaches its final state
        j = p - (eos - (K - 1))
        acc += tl.load(DFIN + (n * D + c[None, :]) * (K - 1) + j[:, None],
                       mask=((j >= 0) & ok_i)[:, None] & ok_c[None, :], other=0.0)  # fmt: skip
    tl.store(DH + (n * D + c[None, :]) * (K - 1) + i[:, None], acc,
             mask=ok_i[:, None] & ok_c[None, :])  # fmt: skip


def _state_grad(xr, w, bias, state, start, end, rows, dyr, dfin, activation, n):
    d, k = w.shape
    dh = torch.empty(n, d, k - 1, dtype=torch.float32, device=xr.device)
    if n and k > 1:
        _dstate_kernel[(n, triton.cdiv(d, BD))](
            xr,
            w,
            bias if bias is not None else w,
            state,
            start,
            end,
            rows,
            dyr,
            dfin if dfin is not None else w,
            dh,
            xr.stride(0),
            xr.stride(1),
            dyr.stride(0),
            dyr.stride(1),
            d,
            K=k,
            HAS_B=bias is not None,
            HAS_F=dfin is not None,
            SILU=activation == "silu",
            KP=_kp(k),
            BD=BD,
        )
    return dh


def _kp(k: int) -> int:
    return triton.next_power_of_2(max(1, k - 1))


def _examples(x, cu_seqlens):
    """(start (N,), end (N,), row (N,)) int64 on x's device, and the longest example."""
    b, _, t = x.shape
    if cu_seqlens is None:
        start, end, rows = torch.zeros(b), torch.full((b,), t), torch.arange(b)
    else:
        cu = cu_seqlens.to("cpu", torch.int64)
        start, end, rows = cu[:-1], cu[1:], torch.zeros(cu.numel() - 1)
    longest = int((end - start).max()) if len(start) else 0
    return (*(v.to(device=x.device, dtype=torch.int64) for v in (start, end, rows)), longest)


def _operands(x, weight, bias, initial_state):
    xr = x.transpose(1, 2)  # (B, T, D)
    xr = xr if xr.stride(2) == 1 else xr.contiguous()
    state = None if initial_state is None else initial_state.contiguous()
    return xr, weight.contiguous(), None if bias is None else bias.contiguous(), state


def forward(x, weight, bias, activation, initial_state, cu_seqlens, n):
    """``(y (B, D, T) x.dtype, channels adjacent in memory; final (N, D, K-1) x.dtype)``."""
    check_device("causal_conv1d", x, weight, bias, initial_state)
    b, d, t = x.shape
    k = weight.shape[1]
    xr, w, bias, state = _operands(x, weight, bias, initial_state)
    start, end, rows, longest = _examples(x, cu_seqlens)
    y = torch.empty(b, t, d, dtype=x.dtype, device=x.device)
    final = torch.empty(n, d, k - 1, dtype=x.dtype, device=x.device)
    flags = dict(K=k, HAS_S=state is not None)
    dummy = w  # never read where its flag is off
    if longest:
        grid = (n, triton.cdiv(longest, BT), triton.cdiv(d, BD))
        _fwd_kernel[grid](xr, w, bias if bias is not None else dummy, state if state is not None
                          else dummy, start, end, rows, y, xr.stride(0), xr.stride(1), t, d,
                          HAS_B=bias is not None, SILU=activation == "silu", BT=BT, BD=BD,
                          **flags)  # fmt: skip
    if k > 1 and n:
        _final_kernel[(n, triton.cdiv(d, BD))](xr, state if state is not None else dummy, start,
                                               end, rows, final, xr.stride(0), xr.stride(1), d,
                                               KP=_kp(k), BD=BD, **flags)  # fmt: skip
    return y.transpose(1, 2), final


def backward(dy, dfinal, x, weight, bias, activation, initial_state, cu_seqlens, n, needs):
    """``(dx, dweight, dbias, dinitial_state)`` in their inputs' dtypes, None where not asked."""
    check_device("causal_conv1d", dy, x, weight, bias, initial_state)
    b, d, t = x.shape
    k = weight.shape[1]
    xr, w, bias_c, state = _operands(x, weight, bias, initial_state)
    dyr = dy.transpose(1, 2)
    dyr = dyr if dyr.stride(2) == 1 else dyr.contiguous()
    start, end, rows, longest = _examples(x, cu_seqlens)
    nt = triton.cdiv(max(longest, 1), BT)
    dx = torch.empty(b, t, d, dtype=x.dtype, device=x.device)
    parts = torch.zeros(n, nt, k + 1, d, dtype=torch.float32, device=x.device)
    dfin = None if dfinal is None else dfinal.to(torch.float32).contiguous()
    dummy = w
    if longest:
        _bwd_kernel[(n, nt, triton.cdiv(d, BD))](
            xr,
            w,
            bias_c if bias_c is not None else dummy,
            state if state is not None else dummy,
            start,
            end,
            rows,
            dyr,
            dfin if dfin is not None else dummy,
            dx,
            parts,
            xr.stride(0),
            xr.stride(1),
            dyr.stride(0),
            dyr.stride(1),
            t,
            d,
            nt,
            K=k,
            HAS_B=bias_c is not None,
            HAS_S=state is not None,
            HAS_F=dfin is not None,
            SILU=activation == "silu",
            BT=BT,
            BD=BD,
        )
    sums = parts.sum((0, 1))  # (K + 1, D)
    dw = sums[:k].t().to(weight.dtype) if needs[1] else None
    db = sums[k].to(bias.dtype) if needs[2] and bias is not None else None
    dh = None
    if needs[3] and initial_state is not None:
        dh = _state_grad(xr, w, bias_c, state, start, end, rows, dyr, dfin, activation, n)
        dh = dh.to(initial_state.dtype)
    return (dx.transpose(1, 2) if needs[0] else None), dw, db, dh
