"""The rank-r products of the split path (:mod:`lorafuse.ops.lora_split`): the LoRA halves of a
projection between a large operand (x (N, d) or g (N, k)) and the small adapter operands.

Two implementations behind one interface (:class:`RankOps`): the torch reference
(:data:`TORCH_RANK_OPS`) and ``csrc/lora_rank*.cpp`` (:func:`rank_ops` chooses, for the ``cpp``
backend and fp32 adapters; the C++ then picks FMA, fp32 tiles or bf16x3 GEMMs by CPU, see
:func:`cpp_rank_bf16x3`). Tested by ``tests/ops/test_lora_rank.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lorafuse import backends


class RankOps(NamedTuple):
    """The rank-r products of the split path between a large operand (x (N, d) or g (N, k), in
    its own dtype) and small ones in the rank dtype (A (R, d), B (k, r), xa (N, r), gB (N, R)).

    ``down(x, A, mask=None, keep=1) -> dropout(x)·Aᵀ`` (N, R); ``up_add_(y, xa, B, s)``: ``y +=
    s·xa·Bᵀ`` in place, one rounding into y's dtype; ``grads(g, B, xa, s, need_gB, need_dB) ->
    (s·g·B, s·gᵀ·xa)`` (None where not asked); ``dA(gB, x, mask=None, keep=1) ->
    gBᵀ·dropout(x)`` (R, d); ``dx_add_(dx, gB, A, mask=None, keep=1)``: ``dx += dropout(gB·A)``
    in place, one rounding. ``dropout(t)`` is ``t * mask / keep`` (no mask: t).
    """

    down: Any
    up_add_: Any
    grads: Any
    dA: Any
    dx_add_: Any


def masked(t, mask, keep):
    """``t`` scaled as ``nn.Dropout`` scales its input, ``t * mask / keep`` (None: ``t``)."""
    return t if mask is None else t * mask.to(t.dtype).div_(keep)


def _torch_grads(g, B, xa, s, need_gB, need_dB):
    gr = g.to(B.dtype)  # (N, k)
    gB = (gr @ B).mul_(s) if need_gB else None  # (N, r)
    dB = (gr.t() @ xa).mul_(s) if need_dB else None  # (k, r)
    return gB, dB


# The reference: plain tensor expressions. With fp32 adapters on a bf16 base they form (N, d) and
# (N, k) fp32 tensors (x and g cast, xa·Bᵀ and gB·A before they are added).
TORCH_RANK_OPS = RankOps(
    down=lambda x, A, mask=None, keep=1.0: masked(x.to(A.dtype), mask, keep) @ A.t(),
    up_add_=lambda y, xa, B, s: y.add_(xa @ B.t(), alpha=s),
    grads=_torch_grads,
    dA=lambda gB, x, mask=None, keep=1.0: gB.t() @ masked(x.to(gB.dtype), mask, keep),
    dx_add_=lambda dx, gB, A, mask=None, keep=1.0: dx.add_(masked(gB.to(A.dtype) @ A, mask, keep)),
)


def _cpp_rank_ops() -> RankOps:
    """``csrc/lora_rank.cpp``: the same fp32 products in one pass over the large operand
    (register-blocked FMA kernels converting it in registers; fp32 row tiles in cache for r past
    two vectors), so no (N, d) or (N, k) fp32 tensor is formed; where bf16 products are several
    times faster than fp32 FMA (AMX), x·Aᵀ, g·B, gᵀ·xa and gBᵀ·x of a bf16 operand as "bf16x3"
    GEMMs (the fp32 operand split into three bf16 parts, exact to fp32). Measured by
    ``benchmarks/ops/lora_rank.py --threads 1 --cpu-time`` (torch/cpp time on SmolLM2-135M's
    shapes, AMX Xeon: up_add_ 3.4x, dx_add_ 4.0x, grads 1.5x, down 1.4x, dA 1.4x)."""
    down, up_add_, grads, dA, dx_add_ = backends.compiled(
        "lora_rank", "cpp", "down", "up_add_", "grads", "dA", "dx_add_"
    )
    return RankOps(
        down=lambda x, A, mask=None, keep=1.0: down(x, A, mask, float(keep)),
        up_add_=lambda y, xa, B, s: up_add_(y, xa, B, float(s)),
        grads=lambda g, B, xa, s, need_gB, need_dB: tuple(
            t if need else None
            for t, need in zip(grads(g, B, xa, float(s), need_gB, need_dB), (need_gB, need_dB))
        ),
        dA=lambda gB, x, mask=None, keep=1.0: dA(gB, x, mask, float(keep)),
        dx_add_=lambda dx, gB, A, mask=None, keep=1.0: dx_add_(dx, gB, A, mask, float(keep)),
    )


# ---- Policy: which rank-r products run (C++ for fp32 adapters on cpp; its kernels by CPU) ----


def cpp_rank_bf16x3() -> bool:
    """Whether the C++ rank-r products take bf16x3 for a bf16 large operand on this machine (AMX:
    bf16 products native, torch's oneDNN packs bf16 and MKL's bf16 GEMM found; ``use_bf16x3`` in
    ``csrc/lora_rank_bf16x3.cpp`` says why only there), else the FMA kernels or fp32 tiles."""
    (active,) = backends.compiled("lora_rank", "cpp", "bf16x3_active")
    return bool(active())


def rank_ops(backend: str, rank_dtype: torch.dtype, out_dtype: torch.dtype) -> RankOps:
    """The rank-r products for ``backend``: the C++ ones where they apply (``cpp``, products in
    fp32, outputs added into fp32/bf16/fp16), else :data:`TORCH_RANK_OPS`."""
    lowp = (torch.float32, torch.bfloat16, torch.float16)
    if backend == "cpp" and rank_dtype == torch.float32 and out_dtype in lowp:
        return _cpp_rank_ops()
    return TORCH_RANK_OPS
