"""Triton gated delta rule: the chunked forward and the one-token decoding step (no backward).

Contract: ``lorafuse.ops.gated_delta_chunks.forward`` without ``save_states`` (the op runs its
torch backend where a gradient is asked for: the Triton kernels have no backward yet). Shapes:
q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), g, beta (B, T, Hv); states (N, Hv, Dk, Dv) fp32.

* :func:`forward`: one program per (example, value head, block of BV value columns), walking the
  example's chunks of C = 64 tokens with the state block (Dk x BV, fp32) in registers: per chunk
  the decays, M and P, (I + M)⁻¹ by forward substitution over the chunk's rows, U, W, V' = U - W S,
  O = diag(e) Q S + P V', S = e_L S + (diag(f) K)ᵀ V' (the notation of ``ops/gated_delta_chunks``).
  Padding (rows past the example's end) loads as zero with g = 0, beta = 0: the state passes it
  unchanged. Products fp32 (IEEE unless torch allows TF32).
* :func:`forward` with one token per row (decoding): one program per (row, head, value block)
  runs the recurrence on the state block: S = a S + k δᵀ, δ = β (v - a Sᵀk), o = Sᵀq.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafuse.triton._common import cast_to, check_device, dot_acc, dot_precision, fsum

CHUNK = 64


@triton.jit
def _l2norm_rows(x, ON: tl.constexpr):
    if ON:
        x = x / tl.sqrt(fsum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _chunk_fwd_kernel(
    Q, K, V, G, BETA, CU, H0, OUT, HT, Hk, Hv, Dk, Dv, scale,
    HAS_H0: tl.constexpr, L2NORM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    n, h, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(CU + n).to(tl.int64)
    eos = tl.load(CU + n + 1).to(tl.int64)
    hk = h // (Hv // Hk)
    rk, rv, rows = tl.arange(0, BK), iv * BV + tl.arange(0, BV), tl.arange(0, C)
    ok_k, ok_v = rk < Dk, rv < Dv
    s_off = ((n * Hv + h) * Dk + rk[:, None]) * Dv + rv[None, :]
    s_ok = ok_k[:, None] & ok_v[None, :]
    state = tl.full((BK, BV), 0.0, tl.float32)
    if HAS_H0:
        state = tl.load(H0 + s_off, mask=s_ok, other=0.0).to(tl.float32)
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for c0 in range(bos, eos, C):
        tok = c0 + rows
        ok_t = tok < eos
        qk_ok = ok_t[:, None] & ok_k[None, :]
        q = tl.load(Q + (tok[:, None] * Hk + hk) * Dk + rk[None, :], mask=qk_ok, other=0.0)
        k = tl.load(K + (tok[:, None] * Hk + hk) * Dk + rk[None, :], mask=qk_ok, other=0.0)
        v = tl.load(V + (tok[:, None] * Hv + h) * Dv + rv[None, :],
                    mask=ok_t[:, None] & ok_v[None, :], other=0.0).to(tl.float32)  # fmt: skip
        g = tl.load(G + tok * Hv + h, mask=ok_t, other=0.0).to(tl.float32)
        beta = tl.load(BETA + tok * Hv + h, mask=ok_t, other=0.0).to(tl.float32)
        q = _l2norm_rows(q.to(tl.float32), L2NORM) * scale
        k = _l2norm_rows(k.to(tl.float32), L2NORM)
        gam = tl.associative_scan(g, 0, _add)  # (C,) log decay from the chunk start
        gam_last = fsum(g, 0)  # padding has g = 0
        dm = tl.exp(tl.where(lower, gam[:, None] - gam[None, :], float("-inf")))
        zero_cc = tl.full((C, C), 0.0, tl.float32)
        m = tl.where(strict, dot_acc(k, tl.trans(k), zero_cc, PREC) * beta[:, None] * dm, 0.0)
        p = tl.where(lower, dot_acc(q, tl.trans(k), zero_cc, PREC) * dm, 0.0)
        tinv = eye  # (I + M)⁻¹: row i = e_i - Σ_{r<i} M[i, r]·row r
        for i in range(1, C):
            mi = fsum(tl.where(rows[:, None] == i, m, 0.0), 0)  # row i of M, over r
            new = -fsum(mi[:, None] * tinv, 0)
            tinv = tl.where(rows[:, None] == i, new[None, :] + eye, tinv)
        e = tl.exp(gam)
        u = dot_acc(tinv, v * beta[:, None], tl.full((C, BV), 0.0, tl.float32), PREC)
        w = dot_acc(tinv, k * (beta * e)[:, None], tl.full((C, BK), 0.0, tl.float32), PREC)
        vn = u - dot_acc(w, state, tl.full((C, BV), 0.0, tl.float32), PREC)
        o = dot_acc(q * e[:, None], state, tl.full((C, BV), 0.0, tl.float32), PREC)
        o = dot_acc(p, vn, o, PREC)
        tl.store(OUT + (tok[:, None] * Hv + h) * Dv + rv[None, :], cast_to(o, OUT.dtype.element_ty),
                 mask=ok_t[:, None] & ok_v[None, :])  # fmt: skip
        kd = k * tl.exp(gam_last - gam)[:, None]
        state = dot_acc(tl.trans(kd), vn, state * tl.exp(gam_last), PREC)
    tl.store(HT + s_off, state, mask=s_ok)


@triton.jit
def _step_kernel(
    Q, K, V, G, BETA, H0, OUT, HT, Hk, Hv, Dk, Dv, scale,
    HAS_H0: tl.constexpr, L2NORM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    b, h, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // (Hv // Hk)
    rk, rv = tl.arange(0, BK), iv * BV + tl.arange(0, BV)
    ok_k, ok_v = rk < Dk, rv < Dv
    s_off = ((b * Hv + h) * Dk + rk[:, None]) * Dv + rv[None, :]
    s_ok = ok_k[:, None] & ok_v[None, :]
    state = tl.full((BK, BV), 0.0, tl.float32)
    if HAS_H0:
        state = tl.load(H0 + s_off, mask=s_ok, other=0.0).to(tl.float32)
    q = tl.load(Q + (b * Hk + hk) * Dk + rk, mask=ok_k, other=0.0).to(tl.float32)
    k = tl.load(K + (b * Hk + hk) * Dk + rk, mask=ok_k, other=0.0).to(tl.float32)
    v = tl.load(V + (b * Hv + h) * Dv + rv, mask=ok_v, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(fsum(q * q, 0) + 1e-6)
        k = k / tl.sqrt(fsum(k * k, 0) + 1e-6)
    q = q * scale
    a = tl.exp(tl.load(G + b * Hv + h).to(tl.float32))
    beta = tl.load(BETA + b * Hv + h).to(tl.float32)
    state = state * a
    delta = beta * (v - fsum(state * k[:, None], 0))
    state = state + k[:, None] * delta[None, :]
    o = fsum(state * q[:, None], 0)
    tl.store(OUT + (b * Hv + h) * Dv + rv, cast_to(o, OUT.dtype.element_ty), mask=ok_v)
    tl.store(HT + s_off, state, mask=s_ok)


def forward(q, k, v, g, beta, initial_state, cu_seqlens, l2norm, save_states, chunk=CHUNK):
    """``(o (B, T, Hv, Dv) v.dtype, final (N, Hv, Dk, Dv) fp32, states (0, Hv, Dk, Dv))``.
    ``chunk``: tokens per chunk (a power of two >= 16; the results do not depend on it beyond
    rounding: the interpreter tests run 16, ~16x fewer interpreted steps than 64)."""
    if save_states:
        raise ValueError("lorafuse.triton.gated_delta: forward only (no chunk states to save)")
    check_device("gated_delta", q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    b, t, hv, dv = v.shape
    hk, dk = k.shape[2], k.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    out = torch.empty_like(v)
    final = torch.empty(n, hv, dk, dv, dtype=torch.float32, device=v.device)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    bk, bv = max(16, triton.next_power_of_2(dk)), min(64, max(16, triton.next_power_of_2(dv)))
    grid = (n, hv, triton.cdiv(dv, bv))
    common = dict(HAS_H0=h0 is not None, L2NORM=bool(l2norm), BK=bk, BV=bv)
    if t == 1 and cu_seqlens is None:  # decoding: one token a row
        _step_kernel[grid](q, k, v, g, beta, h0 if h0 is not None else final, out, final, hk, hv,
                           dk, dv, dk**-0.5, **common)  # fmt: skip
    elif t > 0:
        if cu_seqlens is None:
            cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int64, device=v.device)
        else:
            cu = cu_seqlens.to(device=v.device, dtype=torch.int64)
        _chunk_fwd_kernel[grid](q, k, v, g, beta, cu, h0 if h0 is not None else final, out, final,
                                hk, hv, dk, dv, dk**-0.5, C=chunk, PREC=dot_precision(torch.float32),
                                **common)  # fmt: skip
    else:
        final.copy_(h0) if h0 is not None else final.zero_()
    return out, final, final.new_empty(0, hv, dk, dv)
