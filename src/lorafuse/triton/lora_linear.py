"""Triton fused LoRA linear: ``y = x·Wᵀ + b + s·xa·Bᵀ`` with ``xa = dropout(x)·Aᵀ``.

Contract: :func:`lorafuse.ops.lora_linear._torch_forward` / ``_torch_backward``.
Shapes: x (N, d), W (k, d), b (k,), A (r, d), B (k, r), mask (N, d) bool, g (N, k).

Two kernels do all the large work:

* ``_skinny_kernel``: ``out (N, r) = scale · (x ∘ mask/keep) · Mᵀ`` for a rank-r matrix M given by
  strides. Forward: ``xa = dropout(x)·Aᵀ``; backward: ``gB = s·g·B``. The cast of x (or g) to the
  adapter dtype and the dropout multiply happen in registers: no dropped copy of x is made.
* ``_lora_gemm_kernel``: a tiled GEMM ``out = X·Wv`` (K-loop in X's dtype, fp32 accumulator) whose
  epilogue adds the rank-r term ``scale · mask/keep ∘ (Z·L)`` (a short loop over r, fp32
  accumulation), the bias, and the cast to the output dtype, all before the tile is stored.
  Forward: ``y = x·Wᵀ + s·xa·Bᵀ + b``; backward: ``dx = g·W + mask/keep ∘ (gB·A)``.
  The N×k (N×d) LoRA product is never written to memory, and ``B·A`` is never formed.

``dA = gBᵀ·dropout(x)`` (r, d), ``dB = s·gᵀ·xa`` (k, r) and ``db`` are reductions over the N
tokens into small outputs; they use ``torch.mm`` / ``sum`` (cuBLAS splits the long N reduction
across the GPU, which a one-tile-per-output Triton GEMM would not).
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
    interpreted,
    pow2_at_least,
)


@triton.jit
def _skinny_kernel(
    X, MASK, MAT, OUT, M, K, R,
    sxm, sxk, smm, smk, s_mat_r, s_mat_k, som, sor,
    scale, inv_keep,
    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """out[M, R] = scale * (X ∘ mask·inv_keep)[M, K] · MAT[R, K]ᵀ, operands in MAT's dtype."""
    pid = tl.program_id(0)
    rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    row_ok = rm[:, None] < M
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xm = row_ok & (rk[None, :] < K)
        x = tl.load(X + rm[:, None] * sxm + rk[None, :] * sxk, mask=xm, other=0.0)
        mat = tl.load(
            MAT + rk[:, None] * s_mat_k + rr[None, :] * s_mat_r,
            mask=(rk[:, None] < K) & (rr[None, :] < R),
            other=0.0,
        )  # (BLOCK_K, BLOCK_R)
        x = cast_to(x, mat.dtype)  # like x.to(lora_A.dtype) in the reference
        if HAS_MASK:
            keep = tl.load(MASK + rm[:, None] * smm + rk[None, :] * smk, mask=xm, other=0)
            # reference: x * (mask.to(adapter dtype) / keep), each product rounded to that dtype
            x = tl.where(keep != 0, cast_to(x.to(tl.float32) * inv_keep, mat.dtype), 0.0).to(
                mat.dtype
            )
        acc = dot_acc(x, mat, acc, PREC)
    out = cast_to(acc * scale, OUT.dtype.element_ty)
    tl.store(OUT + rm[:, None] * som + rr[None, :] * sor, out, mask=row_ok & (rr[None, :] < R))


@triton.jit
def _rank_tiles(Z, L, rm, rn, r0, M, N, R, szm, szr, slr, sln, BLOCK_R: tl.constexpr):
    """The (BLOCK_M, BLOCK_R) tile of Z and the (BLOCK_R, BLOCK_N) tile of L at rank offset r0."""
    rr = r0 + tl.arange(0, BLOCK_R)
    z = tl.load(Z + rm[:, None] * szm + rr[None, :] * szr,
                mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0)  # fmt: skip
    lm = tl.load(L + rr[:, None] * slr + rn[None, :] * sln,
                 mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)  # fmt: skip
    return z, lm


@triton.jit
def _lora_gemm_kernel(
    X, W, Z, L, BIAS, MASK, OUT, M, N, K, R,
    sxm, sxk, swk, swn, szm, szr, slr, sln, smm, smn, som, son,
    lora_scale, inv_keep,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, PREC: tl.constexpr, PREC_LORA: tl.constexpr,
):  # fmt: skip
    """out[M, N] = X·Wv + lora_scale·(mask·inv_keep ∘ Z·L) + bias, one (BLOCK_M, BLOCK_N) tile."""
    pid = tl.program_id(0)
    # Grouped tile order: GROUP_M row-tiles share each W column-tile while it is in L2.
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptr = X + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk
    w_ptr = W + rk[:, None] * swk + rn[None, :].to(tl.int64) * swn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr, mask=(rm[:, None] < M) & (rk[None, :] < K - k0), other=0.0)
        w = tl.load(w_ptr, mask=(rk[:, None] < K - k0) & (rn[None, :] < N), other=0.0)
        acc = dot_acc(x, w, acc, PREC)
        x_ptr += BLOCK_K * sxk
        w_ptr += BLOCK_K * swk
    # Epilogue: the rank-r term in the adapter dtype's operands, fp32 accumulation.
    out_ok = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_MASK:
        # dropout multiplies the rank-r product elementwise: it needs its own accumulator tile
        lora = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for r0 in range(0, R, BLOCK_R):
            z, lm = _rank_tiles(Z, L, rm, rn, r0, M, N, R, szm, szr, slr, sln, BLOCK_R)
            lora = dot_acc(z, lm, lora, PREC_LORA)
        keep = tl.load(
            MASK + rm[:, None].to(tl.int64) * smm + rn[None, :] * smn, mask=out_ok, other=0
        )
        acc += tl.where(keep != 0, lora * inv_keep, 0.0) * lora_scale
    else:
        # scale folded into the (BLOCK_M, BLOCK_R) z tile, products accumulated straight into acc:
        # no second (BLOCK_M, BLOCK_N) fp32 tile, which would double the accumulator registers
        for r0 in range(0, R, BLOCK_R):
            z, lm = _rank_tiles(Z, L, rm, rn, r0, M, N, R, szm, szr, slr, sln, BLOCK_R)
            z = cast_to(z.to(tl.float32) * lora_scale, z.dtype)
            acc = dot_acc(z, lm, acc, PREC_LORA)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    o_ptr = OUT + rm[:, None].to(tl.int64) * som + rn[None, :] * son
    tl.store(o_ptr, cast_to(acc, OUT.dtype.element_ty), mask=out_ok)


def _gemm_blocks(device, M, N, K, R, dtype, masked):
    """Tile sizes. Pending the H200 sweep in benchmarks/ops/gpu_all.py; IEEE fp32 runs on CUDA
    cores, where smaller tiles keep registers from spilling."""
    if interpreted(device):  # few, large programs: the interpreter's cost is per program
        return dict(BLOCK_M=min(64, pow2_at_least(M)), BLOCK_N=min(64, pow2_at_least(N)),
                    BLOCK_K=min(64, pow2_at_least(K)), BLOCK_R=min(64, pow2_at_least(R)),
                    GROUP_M=4, num_warps=4, num_stages=1)  # fmt: skip
    block_r = min(64, pow2_at_least(R))
    if dtype in (torch.bfloat16, torch.float16):
        if M <= 64:
            return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, BLOCK_R=block_r, GROUP_M=8,
                        num_warps=4, num_stages=3)  # fmt: skip
        # 128x256x64 / 8 warps / 3 stages: the Triton matmul tutorial's best fp16 tile on H100
        # (144 KiB of shared memory); the masked epilogue's second fp32 tile wants 128x128.
        block_n = 256 if N >= 1024 and not masked else 128
        return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64, BLOCK_R=block_r, GROUP_M=8,
                    num_warps=8, num_stages=3)  # fmt: skip
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, BLOCK_R=min(32, block_r), GROUP_M=8,
                num_warps=4, num_stages=3)  # fmt: skip


def _lora_gemm(x, w_view, z, l_view, bias, mask, scale, inv_keep, out, cfg=None):
    """out (M, N) = x (M, K) · w_view (K, N) + scale·(mask/keep ∘ z (M, R) · l_view (R, N)) + bias.

    ``cfg`` overrides the tile configuration (benchmarks/ops/gpu_all.py sweeps it)."""
    M, K = x.shape
    N = w_view.shape[1]
    R = z.shape[1]
    cfg = cfg or _gemm_blocks(x.device, M, N, K, R, x.dtype, mask is not None)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    m = mask if mask is not None else out  # placeholder pointer, never read
    _lora_gemm_kernel[grid](
        x, w_view, z, l_view, bias if bias is not None else out, m, out, M, N, K, R,
        x.stride(0), x.stride(1), w_view.stride(0), w_view.stride(1),
        z.stride(0), z.stride(1), l_view.stride(0), l_view.stride(1),
        m.stride(0), m.stride(1), out.stride(0), out.stride(1),
        float(scale), float(inv_keep),
        HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
        PREC=dot_precision(x.dtype), PREC_LORA=dot_precision(z.dtype), **cfg,
    )  # fmt: skip
    return out


def _skinny(x, mask, mat_rk, scale, inv_keep, out):
    """out (M, R) = scale · (x ∘ mask·inv_keep) (M, K) · mat_rk (R, K)ᵀ in mat_rk's dtype."""
    M, K = x.shape
    R = mat_rk.shape[0]
    block_r = pow2_at_least(R)
    block_m = 64 if interpreted(x.device) else 32 if block_r > 64 else 64
    block_k = min(128, pow2_at_least(K)) if block_r <= 64 else 64
    m = mask if mask is not None else x  # placeholder pointer, never read
    _skinny_kernel[(triton.cdiv(M, block_m),)](
        x, m, mat_rk, out, M, K, R,
        x.stride(0), x.stride(1), m.stride(0), m.stride(1),
        mat_rk.stride(0), mat_rk.stride(1), out.stride(0), out.stride(1),
        float(scale), float(inv_keep),
        HAS_MASK=mask is not None, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r,
        PREC=dot_precision(mat_rk.dtype), num_warps=4,
    )  # fmt: skip
    return out


def _inv_keep(keep: float, dtype: torch.dtype) -> float:
    """1/keep rounded to the adapter dtype, as ``mask.to(dtype).div_(keep)`` rounds it."""
    return torch.tensor(1.0, dtype=dtype).div_(keep).item()


def _mask_bytes(mask):
    return None if mask is None else mask.view(torch.uint8)  # bool -> 1-byte ints for tl.load


def forward(x, weight, bias, lora_A, lora_B, scaling, mask, keep):
    """``(y (N, k) in x's dtype, xa (N, r) in the adapter dtype)``; see module docstring."""
    check_device("lora_linear", x, weight, bias, lora_A, lora_B, mask)
    check_contiguous("lora_linear", x=x, weight=weight, lora_A=lora_A, lora_B=lora_B, mask=mask)
    N = x.shape[0]
    k, r = lora_B.shape
    adapter = lora_A.dtype
    inv_keep = _inv_keep(keep, adapter) if mask is not None else 1.0
    xa = torch.empty((N, r), dtype=adapter, device=x.device)
    _skinny(x, _mask_bytes(mask), lora_A, 1.0, inv_keep, xa)  # (N, r)
    y = torch.empty((N, k), dtype=x.dtype, device=x.device)
    # y = x·Wᵀ (W viewed as (d, k)) + s·xa·Bᵀ (B viewed as (r, k)) + b
    _lora_gemm(x, weight.t(), xa, lora_B.t(), bias, None, scaling, 1.0, y)
    return y, xa


def backward(g, x, weight, lora_A, lora_B, xa, scaling, mask, keep, needs):
    """``(dx, dA, dB, db)``, each None unless asked for in ``needs``."""
    need_dx, need_dA, need_dB, need_db = needs
    check_device("lora_linear", g, x, weight, lora_A, lora_B, xa, mask)
    check_contiguous("lora_linear", g=g, x=x, weight=weight, lora_A=lora_A, lora_B=lora_B)
    adapter = lora_A.dtype
    inv_keep = _inv_keep(keep, adapter) if mask is not None else 1.0
    dx = dA = dB = db = None
    if need_dx or need_dA:
        gB = torch.empty((g.shape[0], lora_B.shape[1]), dtype=adapter, device=g.device)
        _skinny(g, None, lora_B.t(), scaling, 1.0, gB)  # (N, r) = s·g·B, B viewed as (r, k)
    if need_dB:
        dB = (g.to(adapter).t() @ xa).mul_(scaling)  # (k, r)
    if need_dA:
        xl = x.to(adapter)  # (N, d)
        if mask is not None:
            xl = xl * mask.to(adapter).div_(keep)
        dA = gB.t() @ xl  # (r, d)
    if need_dx:
        dx = torch.empty_like(x)
        # dx = g·W (W is (k, d)) + mask/keep ∘ (gB·A)
        _lora_gemm(g, weight, gB, lora_A, None, _mask_bytes(mask), 1.0, inv_keep, dx)
    if need_db:
        db = g.sum(0, dtype=torch.float32).to(g.dtype)
    return dx, dA, dB, db
