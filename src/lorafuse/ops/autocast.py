"""The fused ops under ``torch.autocast``: they follow it the way the ops they replace do.

Autocast runs ``linear``/``matmul`` (and SDPA) with every floating operand cast to its dtype
(``torch.get_autocast_dtype``: bf16 on CPU, fp16 or bf16 on CUDA), keeps ``cross_entropy`` in
fp32, and leaves elementwise ops (RMSNorm's math, SiLU, RoPE's products) alone. A fused op that
holds matrix products does the same *at its entry point*:

1. cast ``x``, the base weight and bias and the LoRA ``A``/``B`` to the autocast dtype (plain
   autograd casts, so gradients flow back to fp32 adapters and activations exactly as through
   autocast's own casts; quantized weight objects are dequantized straight into that dtype);
2. run the op's ``autograd.Function`` with autocast **off** (:func:`disabled`), and its backward
   too, so forward and backward see one consistent dtype. With autocast left on, the kernels'
   own ``at::mm`` calls were recast behind their back: bf16 saved tensors met fp32 ones in
   backward ("expected m1 and m2 to have the same dtype ... BFloat16 != float").

The products themselves then run as the kernels run any bf16 input, by
:func:`lorafuse.hardware.matmul_dtype`: natively in bf16 on CUDA and on CPUs with AVX-512-BF16 /
AMX, widened to fp32 inside the kernel elsewhere. The operands are still rounded to bf16 first,
on purpose: products of bf16 values are exact in fp32 and both paths accumulate in fp32, so the
numbers are those of autocast's own (emulated, ~100x slower) bf16 GEMM, the same on every CPU,
and activations/saved tensors keep autocast's size. Skipping the casts on such CPUs would be
more accurate but would make an autocast run's numbers depend on the CPU it ran on.
"""

from __future__ import annotations

import contextlib

import torch

from lorafuse.ops.weights import is_quantized


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a product on ``t``'s device in, or None when it is off."""
    kind = t.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def cast(t, dtype: torch.dtype):
    """``t`` as autocast casts a product's operand: floating tensors (but fp64) to ``dtype``.

    None and quantized weight objects pass through (the op dequantizes those into x's dtype).
    """
    if t is None or is_quantized(t):
        return t
    if not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def disabled(device: torch.device | str):
    """A context with autocast off for ``device``'s type (a no-op context when it is off)."""
    kind = torch.device(device).type
    if not torch.is_autocast_enabled(kind):
        return contextlib.nullcontext()
    return torch.autocast(kind, enabled=False)
