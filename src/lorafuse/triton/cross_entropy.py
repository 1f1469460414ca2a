"""Triton cross-entropy chunk kernel: loss per row and the logits' gradient, in place.

Contract: ``lorafuse.ops.cross_entropy`` chunk kernel ``chunk_forward_backward`` (the torch one:
``lorafuse.ops.cross_entropy_chunks.torch_chunk_forward_backward``).
Shapes: logits (n, V) fp32, OVERWRITTEN with d(loss_sum·grad_scale)/d(logits); targets (n,) int64;
returns loss (n,) fp32.

One program per row, two passes over V in BLOCK_V blocks:
1. online logsumexp (running max m and running sum s of exp(x − m)), and the target logit;
2. overwrite the row with grad_scale·(exp(x − lse) − onehot(target)).
Rows whose target is ``ignore_index`` get loss 0 and a zero row. The row is read twice and
written once; no (n, V) temporary exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafuse.triton._common import check_contiguous, check_device, fmax, fsum


@triton.jit
def _ce_chunk_kernel(
    LOGITS, TARGETS, LOSS, V, stride, ignore_index, grad_scale, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    target = tl.load(TARGETS + row)
    if target == ignore_index:
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            tl.store(base + cols, tl.full((BLOCK_V,), 0.0, tl.float32), mask=cols < V)
        tl.store(LOSS + row, 0.0)
    else:
        m = -float("inf")
        s = 0.0
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
            m_new = tl.maximum(m, fmax(x, 0))
            s = s * tl.exp(m - m_new) + fsum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        x_t = tl.load(base + target)
        tl.store(LOSS + row, lse - x_t)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < V, other=0.0)
            grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, grad * grad_scale, mask=cols < V)


def chunk_forward_backward(logits, targets, ignore_index, grad_scale):
    """``loss (n,) fp32``; ``logits`` (n, V) fp32 becomes its gradient (see module docstring)."""
    check_device("cross_entropy", logits, targets)
    check_contiguous("cross_entropy", logits=logits, targets=targets)
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(
            f"lorafuse.triton.cross_entropy: logits must be 2-D fp32, got {tuple(logits.shape)} "
            f"{logits.dtype}"
        )
    n, V = logits.shape
    if targets.shape != (n,) or targets.dtype != torch.int64:
        raise ValueError(
            f"lorafuse.triton.cross_entropy: targets must be ({n},) int64, got "
            f"{tuple(targets.shape)} {targets.dtype}"
        )
    bad = ((targets < 0) | (targets >= V)) & (targets != ignore_index)
    if bool(bad.any()):  # one device sync per chunk; an out-of-range index would read wild memory
        first = int(targets[bad][0])
        raise ValueError(f"cross_entropy: target {first} is outside [0, {V}) and not ignore_index")
    loss = torch.empty((n,), dtype=torch.float32, device=logits.device)
    if n == 0:
        return loss
    block_v = min(4096 if logits.is_cuda else 1024, triton.next_power_of_2(V))
    _ce_chunk_kernel[(n,)](
        logits, targets, loss, V, logits.stride(0), int(ignore_index), float(grad_scale),
        BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
    )  # fmt: skip
    return loss
