"""Triton rotary position embedding, HF ``rotate_half`` convention, q and k in one launch.

Contract: ``lorafuse.ops.rope._torch_forward`` / ``_torch_backward``.
Shapes: q (B, Hq, T, D), k (B, Hk, T, D), cos/sin (B, T, D) (any strides, e.g. an expanded batch);
outputs are new contiguous tensors in q's / k's dtype. Math in fp32.

    forward:  out = t·cos + rotate_half(t)·sin,  rotate_half(t) = cat(−t[D/2:], t[:D/2])
              out₁ = t₁·cos₁ − t₂·sin₁,   out₂ = t₂·cos₂ + t₁·sin₂      (halves 1 and 2)
    backward: the transpose of that linear map (no saved activations)
              dt₁ = d₁·cos₁ + d₂·sin₂,    dt₂ = d₂·cos₂ − d₁·sin₁

One program per (b, t) position: it loads that position's cos/sin once and rotates every head
of q and of k there, as (heads, D/2) blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafuse.triton._common import cast_to, check_device


@triton.jit
def _rotate(
    SRC, DST, H, T, b, t, c1, c2, s1, s2, sb, sh, st, sd, ob, oh, ot,
    HALF, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + heads
        ok = (hh < H) & (cols < HALF)
        src = SRC + b * sb + hh * sh + t * st
        x1 = tl.load(src + cols * sd, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + (cols + HALF) * sd, mask=ok, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        dst = DST + b * ob + hh * oh + t * ot
        tl.store(dst + cols, cast_to(y1, DST.dtype.element_ty), mask=ok)
        tl.store(dst + cols + HALF, cast_to(y2, DST.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, HQ, HK, T, HALF,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, scb, sct, scd, ssb, sst, ssd,
    oqb, oqh, oqt, okb, okh, okt,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    ok = cols < HALF
    c = COS + b * scb + t * sct
    s = SIN + b * ssb + t * sst
    c1 = tl.load(c + cols * scd, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c + (cols + HALF) * scd, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s + cols * ssd, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s + (cols + HALF) * ssd, mask=ok, other=0.0).to(tl.float32)
    _rotate(Q, QO, HQ, T, b, t, c1, c2, s1, s2, sqb, sqh, sqt, sqd, oqb, oqh, oqt, HALF,
            BACKWARD, BLOCK_H, BLOCK_HALF)  # fmt: skip
    _rotate(K, KO, HK, T, b, t, c1, c2, s1, s2, skb, skh, skt, skd, okb, okh, okt, HALF,
            BACKWARD, BLOCK_H, BLOCK_HALF)  # fmt: skip


def _check(q, k, cos, sin):
    check_device("rope", q, k, cos, sin)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"lorafuse.triton.rope: q, k must be (B, H, T, D), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}")  # fmt: skip
    B, _, T, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(
            f"lorafuse.triton.rope: k {tuple(k.shape)} does not match q {tuple(q.shape)}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (B, T, D) and not (
            t.dim() == 3 and t.shape[0] == 1 and t.shape[1:] == (T, D)
        ):
            raise ValueError(
                f"lorafuse.triton.rope: {name} must be ({B}, {T}, {D}), got {tuple(t.shape)}"
            )
    if D % 2:
        raise ValueError(f"lorafuse.triton.rope: head dim {D} must be even")


def _launch(q, k, cos, sin, backward):
    _check(q, k, cos, sin)
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(HQ, HK)), max(1, 4096 // block_half)))
    scb = cos.stride(0) if cos.shape[0] == B else 0  # a (1, T, D) table serves every batch row
    ssb = sin.stride(0) if sin.shape[0] == B else 0
    _rope_kernel[(B * T,)](
        q, k, qo, ko, cos, sin, HQ, HK, T, half,
        *q.stride(), *k.stride(), scb, cos.stride(1), cos.stride(2), ssb, sin.stride(1), sin.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4,
    )  # fmt: skip
    return qo, ko


def forward(q, k, cos, sin):
    """``(q_out, k_out)`` rotated, same shapes and dtypes as q/k."""
    return _launch(q, k, cos, sin, backward=False)


def backward(dq, dk, cos, sin):
    """``(dq_in, dk_in)``: gradients through the rotation (its transpose)."""
    return _launch(dq, dk, cos, sin, backward=True)
