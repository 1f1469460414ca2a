"""Triton SwiGLU: ``h = silu(gate) * up`` with ``silu(z) = z·sigmoid(z)``.

Contract: ``lorafuse.ops.swiglu._torch_forward`` / ``_torch_backward``.
Shapes: gate, up, g, h (N, I). Math in fp32; h and dgate in gate's dtype, dup in up's.

Elementwise over the flattened (N·I) elements, BLOCK elements per program. Backward recomputes
the sigmoid from gate (nothing but gate/up saved), one pass writing both gradients:
    dgate = g·up·σ·(1 + gate·(1 − σ)),   dup = g·gate·σ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafuse.triton._common import cast_to, check_contiguous, check_device, sigmoid

BLOCK = 1024  # 4 warps x 32 lanes x 8 elements: 16-byte bf16 accesses per lane


@triton.jit
def _swiglu_fwd_kernel(GATE, UP, H, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    a = tl.load(GATE + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(UP + offs, mask=ok, other=0.0).to(tl.float32)
    h = a * sigmoid(a) * b
    tl.store(H + offs, cast_to(h, H.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(G, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(GATE + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(UP + offs, mask=ok, other=0.0).to(tl.float32)
    sig = sigmoid(a)
    silu = a * sig
    dgate = g * b * sig * (1.0 + a * (1.0 - sig))
    tl.store(DGATE + offs, cast_to(dgate, DGATE.dtype.element_ty), mask=ok)
    tl.store(DUP + offs, cast_to(g * silu, DUP.dtype.element_ty), mask=ok)


def _check(*pairs):
    check_device("swiglu", *(t for _, t in pairs))
    check_contiguous("swiglu", **dict(pairs))
    shape = pairs[0][1].shape
    for name, t in pairs:
        if t.shape != shape:
            raise ValueError(f"lorafuse.triton.swiglu: {name} {tuple(t.shape)} != {tuple(shape)}")


def forward(gate, up):
    """``h (N, I)`` in gate's dtype."""
    _check(("gate", gate), ("up", up))
    h = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, h, n, BLOCK=BLOCK, num_warps=4)
    return h


def backward(g, gate, up, dgate_into_g=False):
    """``(dgate, dup)`` (N, I) in gate's / up's dtype; ``dgate_into_g``: dgate into g's buffer
    where the dtypes agree (each program loads its g block before storing dgate there)."""
    _check(("g", g), ("gate", gate), ("up", up))
    dgate = g if dgate_into_g and g.dtype == gate.dtype else torch.empty_like(gate)
    dup = torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
            g, gate, up, dgate, dup, n, BLOCK=BLOCK, num_warps=4
        )
    return dgate, dup
