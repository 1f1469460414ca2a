"""The Triton kernels of :mod:`lorafuse.triton.moe_lora` (the launches, the tile table and what
each computes are described there): grouped GEMMs over (expert, row-tile) programs, each reading
its expert's weights through strides; fp32 accumulation, fp32 rank-r products.

Shapes: S sorted pairs; ``TILES`` (3, n_tiles) int32 rows: expert, first row, end row of each
BLOCK_M-row tile of an expert's contiguous slice; ``OFFS`` (E+1,) each expert's first row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lorafuse.triton._common import cast_to, dot_acc, fsum, sigmoid


@triton.jit
def _tile(TILES, n_tiles, BLOCK_M: tl.constexpr):
    """This program's expert, its rows (BLOCK_M,) and which of them exist."""
    pid = tl.program_id(0)
    e = tl.load(TILES + pid)
    start = tl.load(TILES + n_tiles + pid)
    stop = tl.load(TILES + 2 * n_tiles + pid)
    rows = start + tl.arange(0, BLOCK_M)
    return e.to(tl.int64), rows, rows < stop


@triton.jit
def _rows_of(TOK, rows, row_ok, GATHER: tl.constexpr):
    """The source rows of the sorted pairs: x's token rows (``GATHER``) or the pairs themselves."""
    if GATHER:
        return tl.load(TOK + rows, mask=row_ok, other=0).to(tl.int64)
    return rows.to(tl.int64)


@triton.jit
def _base(X, xrows, row_ok, sx, W, swk, swn, cols, col_ok, K, acc,
          BLOCK_K: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``acc + X[xrows, :K]·W[:K, cols]``, X's tile rounded to W's dtype first."""
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + xrows[:, None] * sx + rk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(W + rk[:, None].to(tl.int64) * swk + cols[None, :] * swn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        acc = dot_acc(cast_to(x, w.dtype), w, acc, PREC)
    return acc


@triton.jit
def _rank(Z, rows, row_ok, R, L, slr, sln, cols, col_ok, scale, acc,
          BLOCK_R: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``acc + scale·Z[rows, :R]·L[:R, cols]`` with fp32 operands (Z (S, R) fp32, contiguous)."""
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < R
        z = tl.load(Z + rows[:, None].to(tl.int64) * R + rr[None, :],
                    mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
        lm = tl.load(L + rr[:, None] * slr + cols[None, :] * sln,
                     mask=r_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc = dot_acc(z * scale, lm, acc, PREC)
    return acc


@triton.jit
def _act(gate, up, alpha, limit, CLAMPED: tl.constexpr):
    """h from fp32 gate/up tiles: silu(gate)·up, or gpt-oss's clamped GLU."""
    if CLAMPED:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        return (u + 1.0) * (g * sigmoid(g * alpha))
    return gate * sigmoid(gate) * up


@triton.jit
def _act_bwd(dh, gate, up, alpha, limit, CLAMPED: tl.constexpr):
    """(dgate, dup) in fp32; a clamp passes gradient where min <= v <= max (torch's rule)."""
    if CLAMPED:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        s = sigmoid(g * alpha)
        glu = g * s
        dup = tl.where(tl.abs(up) <= limit, dh * glu, 0.0)
        dgate = tl.where(gate <= limit, dh * (u + 1.0) * (s + alpha * glu * (1.0 - s)), 0.0)
        return dgate, dup
    s = sigmoid(gate)
    return dh * up * s * (1.0 + gate * (1.0 - s)), dh * gate * s


@triton.jit
def rank_kernel(X, sx, TOK, TILES, n_tiles, M, sme, smr, smk, OUT, K, R, scale,
                 GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """OUT[rows, :R] = scale·X[src rows]·M_eᵀ, M_e (R, K) by strides, fp32 operands and result."""
    e, rows, row_ok = _tile(TILES, n_tiles, BLOCK_M)
    xrows = _rows_of(TOK, rows, row_ok, GATHER)
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    m_ptr = M + e * sme
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + xrows[:, None] * sx + rk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        m = tl.load(m_ptr + rk[:, None] * smk + rr[None, :] * smr,
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc = dot_acc(x, m, acc, PREC)
    tl.store(OUT + rows[:, None].to(tl.int64) * R + rr[None, :], acc * scale,
             mask=row_ok[:, None] & r_ok[None, :])  # fmt: skip


@triton.jit
def gate_up_kernel(X, sx, TOK, TILES, n_tiles, W, swe, swk, swn, BIAS, sbe, XA, R, LB, sle,
                    slr, sln, scale, Z, H, NI, K, cs, up0, alpha, limit,
                    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, SAVE: tl.constexpr,
                    CLAMPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
                    PREC_R: tl.constexpr):  # fmt: skip
    """z = x[tok]·W_guᵀ + b + s·xa·B_guᵀ at the gate columns j·cs and up columns j·cs + up0 of
    one column tile j, rounded to x's dtype (stored if SAVE); h = act(z) (S, I) in x's dtype."""
    e, rows, row_ok = _tile(TILES, n_tiles, BLOCK_M)
    xrows = tl.load(TOK + rows, mask=row_ok, other=0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < NI
    gcol, ucol = j * cs, j * cs + up0
    w_ptr = W + e * swe
    gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one K loop, the x tile read once for both halves
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + xrows[:, None] * sx + rk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        wk = w_ptr + rk[:, None].to(tl.int64) * swk
        wm = k_ok[:, None] & j_ok[None, :]
        gate = dot_acc(x, tl.load(wk + gcol[None, :] * swn, mask=wm, other=0.0), gate, PREC)
        up = dot_acc(x, tl.load(wk + ucol[None, :] * swn, mask=wm, other=0.0), up, PREC)
    if HAS_BIAS:
        gate += tl.load(BIAS + e * sbe + gcol, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(BIAS + e * sbe + ucol, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        lb = LB + e * sle
        gate = _rank(XA, rows, row_ok, R, lb, slr, sln, gcol, j_ok, scale, gate, BLOCK_R, PREC_R)
        up = _rank(XA, rows, row_ok, R, lb, slr, sln, ucol, j_ok, scale, up, BLOCK_R, PREC_R)
    dtype = H.dtype.element_ty
    gate, up = cast_to(gate, dtype), cast_to(up, dtype)
    ok = row_ok[:, None] & j_ok[None, :]
    z_row = Z + rows[:, None].to(tl.int64) * (2 * NI)
    if SAVE:
        tl.store(z_row + gcol[None, :], gate, mask=ok)
        tl.store(z_row + ucol[None, :], up, mask=ok)
    h = _act(gate.to(tl.float32), up.to(tl.float32), alpha, limit, CLAMPED)
    tl.store(H + rows[:, None].to(tl.int64) * NI + j[None, :], cast_to(h, dtype), mask=ok)


@triton.jit
def grouped_kernel(X, sx, TOK, TILES, n_tiles, W, swe, swk, swn, BIAS, sbe, Z, R, L, sle, slr,
                    sln, scale, WS, OUT, K, N,
                    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                    HAS_WS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
                    PREC_R: tl.constexpr):  # fmt: skip
    """OUT[rows, cols] (fp32) = ws·(X[src rows]·W_e + b_e + scale·Z[rows]·L_e), W_e (K, N) and
    L_e (R, N) by strides."""
    e, rows, row_ok = _tile(TILES, n_tiles, BLOCK_M)
    xrows = _rows_of(TOK, rows, row_ok, GATHER)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc = _base(X, xrows, row_ok, sx, W + e * swe, swk, swn, cols, col_ok, K, acc, BLOCK_K, PREC)
    if HAS_BIAS:
        acc += tl.load(BIAS + e * sbe + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        acc = _rank(Z, rows, row_ok, R, L + e * sle, slr, sln, cols, col_ok, scale, acc,
                    BLOCK_R, PREC_R)  # fmt: skip
    if HAS_WS:
        acc = acc * tl.load(WS + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(OUT + rows[:, None].to(tl.int64) * N + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def down_bwd_kernel(G, sg, TOK, TILES, n_tiles, W, swe, swk, swn, GB, R, LA, sle, slr, sln,
                     scale, Z, WS, HOUT, DZ, HU, n_col, NI, K, cs, up0, alpha, limit,
                     HAS_LORA: tl.constexpr, CLAMPED: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                     PREC: tl.constexpr, PREC_R: tl.constexpr):  # fmt: skip
    """u = g[tok]·W_d + s·gb·A_d (fp32) at columns j; h = act(z) again (stored, x's dtype);
    HU[rows, tile] = Σ_j h·u; DZ at the gate/up columns = act'(ws·u) (fp32)."""
    e, rows, row_ok = _tile(TILES, n_tiles, BLOCK_M)
    grows = tl.load(TOK + rows, mask=row_ok, other=0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < NI
    u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    u = _base(G, grows, row_ok, sg, W + e * swe, swk, swn, j, j_ok, K, u, BLOCK_K, PREC)
    if HAS_LORA:
        u = _rank(GB, rows, row_ok, R, LA + e * sle, slr, sln, j, j_ok, scale, u, BLOCK_R, PREC_R)
    ok = row_ok[:, None] & j_ok[None, :]
    r64 = rows[:, None].to(tl.int64)
    gcol, ucol = j * cs, j * cs + up0
    gate = tl.load(Z + r64 * (2 * NI) + gcol[None, :], mask=ok, other=0.0).to(tl.float32)
    up = tl.load(Z + r64 * (2 * NI) + ucol[None, :], mask=ok, other=0.0).to(tl.float32)
    h = cast_to(_act(gate, up, alpha, limit, CLAMPED), HOUT.dtype.element_ty)
    tl.store(HOUT + r64 * NI + j[None, :], h, mask=ok)
    hu = fsum(tl.where(ok, h.to(tl.float32) * u, 0.0), 1)  # (BLOCK_M,)
    tl.store(HU + rows.to(tl.int64) * n_col + tl.program_id(1), hu, mask=row_ok)
    ws = tl.load(WS + rows, mask=row_ok, other=0.0).to(tl.float32)
    dgate, dup = _act_bwd(ws[:, None] * u, gate, up, alpha, limit, CLAMPED)
    tl.store(DZ + r64 * (2 * NI) + gcol[None, :], dgate, mask=ok)
    tl.store(DZ + r64 * (2 * NI) + ucol[None, :], dup, mask=ok)


@triton.jit
def outer_kernel(L, sl, LTOK, RM, sr, RTOK, WS, OFFS, OUT, soe, sop, soq, P, Q, scale,
                  L_GATHER: tl.constexpr, R_GATHER: tl.constexpr, HAS_WS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                  PREC: tl.constexpr):  # fmt: skip
    """OUT[e] (P, Q) = scale·Σ over expert e's rows of (ws·)L[row, :P]ᵀ·RM[row, :Q], fp32."""
    e = tl.program_id(0)
    start = tl.load(OFFS + e)
    stop = tl.load(OFFS + e + 1)
    if stop > start:  # an expert without rows: nothing read, nothing written (OUT is zeroed)
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        p_ok, q_ok = p < P, q < Q
        acc = tl.full((BLOCK_P, BLOCK_Q), 0.0, tl.float32)
        for m0 in range(start, stop, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            ok = rows < stop
            lrows = _rows_of(LTOK, rows, ok, L_GATHER)
            rrows = _rows_of(RTOK, rows, ok, R_GATHER)
            lt = tl.load(L + lrows[None, :] * sl + p[:, None], mask=p_ok[:, None] & ok[None, :],
                         other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_M)  # fmt: skip
            if HAS_WS:
                lt = lt * tl.load(WS + rows, mask=ok, other=0.0).to(tl.float32)[None, :]
            rt = tl.load(RM + rrows[:, None] * sr + q[None, :], mask=ok[:, None] & q_ok[None, :],
                         other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_Q)  # fmt: skip
            acc = dot_acc(lt, rt, acc, PREC)
        out = OUT + e.to(tl.int64) * soe + p[:, None] * sop + q[None, :] * soq
        tl.store(
            out, cast_to(acc * scale, OUT.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :]
        )


@triton.jit
def combine_kernel(Y, POS, OUT, T, N, K, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[t] = Σ_k Y[POS[t·K + k]] in fp32 (POS: each token's K pair rows, in expert order)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (t[:, None] < T) & (n[None, :] < N)
    acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    for k in range(0, K):
        rows = tl.load(POS + t.to(tl.int64) * K + k, mask=t < T, other=0).to(tl.int64)
        acc += tl.load(Y + rows[:, None] * N + n[None, :], mask=ok, other=0.0)
    tl.store(OUT + t[:, None].to(tl.int64) * N + n[None, :], cast_to(acc, OUT.dtype.element_ty),
             mask=ok)  # fmt: skip
