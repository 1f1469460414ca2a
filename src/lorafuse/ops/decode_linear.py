"""Dense linear layers given a few rows without autograd (decoding: one new token per sequence).

Decoding reads every weight once per token, so its speed is the bytes/s at which the products
read the weights. On CPU, torch's bf16/fp16 product of one row reads them at about half the
bytes/s of its fp32 product (AVX-512 and AMX CPUs, torch 2.13), so a bf16 model decoded no faster
than the same model in fp32 although it reads half the bytes. ``csrc/decode_linear.cpp`` runs
FMA chains over the weight as stored (converted in registers, fp32 sums, one rounding per
output, as a GEMM with fp32 accumulation does) at 1.4-2x the bytes/s of torch's bf16 product, so
bf16 decodes faster than fp32 again (``benchmarks/ops/decode_linear.py``).

:func:`lorafuse.patching.decoding.install` routes a model's plain ``nn.Linear`` layers here
(``FastLanguageModel.from_pretrained`` and ``for_inference`` call it); NF4 layers decode through
their own kernel (:func:`lorafuse.ops.nf4.decode_linear`).
"""

from __future__ import annotations

import functools
import os

import torch

from lorafuse import backends, hardware

# ---- Policy: which calls take the kernel (rows, dtypes; applies / row_limits) -------------
MAX_ROWS = 8  # the kernel's limit; 0 turns the path off (for models routed after it is set)
# Where the CPU multiplies the dtype natively (AVX-512-BF16 / AMX), torch's product of 4 or more
# rows runs on the matrix units and caught up: `benchmarks/ops/decode_linear.py --rows N` (AMX
# Xeon, bf16, 9 weight shapes) kernel / torch 1.24-2.09x at 2 rows, 1.08-1.74x at 3, 0.91-1.45x at 4,
# 0.46-1.02x at 8. Elsewhere torch's low-precision products are emulated (~100x slower than fp32
# for GEMMs on AVX2 CPUs) and the kernel takes up to MAX_ROWS (not measured on such a CPU).
NATIVE_MAX_ROWS = 3
LOW_PRECISION = (torch.bfloat16, torch.float16)


def applies(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, limit: int | None = None
) -> bool:
    """Whether ``x·Wᵀ + b`` runs as :func:`decode_linear`: 1 to ``limit`` rows, bf16/fp16 CPU
    tensors of one dtype, a contiguous weight, no gradient to carry. ``limit`` None: looked up
    now (:func:`row_limit`, where the C++ kernel is chosen; 0 elsewhere); callers on the per-token
    path pass the one they looked up once (:mod:`lorafuse.patching.decoding`)."""
    if x.dtype not in LOW_PRECISION or not x.is_cpu:
        return False
    if limit is None:
        limit = row_limits().get(x.dtype, 0)
    if not 1 <= x.numel() // max(1, x.shape[-1]) <= limit:
        return False
    if weight.dtype != x.dtype or not weight.is_cpu or not weight.is_contiguous():
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False
    grads = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return not (torch.is_grad_enabled() and grads)


def row_limits() -> dict[torch.dtype, int]:
    """Rows the kernel takes per dtype on this CPU, where ``backends`` chooses the C++ kernel
    (recording that choice); empty elsewhere."""
    if backends.select_cpu("decode_linear") != "cpp":
        return {}
    return {dt: row_limit(dt) for dt in LOW_PRECISION}


def row_limit(dtype: torch.dtype) -> int:
    """The most rows the kernel takes for ``dtype`` on this CPU (see :data:`NATIVE_MAX_ROWS`)."""
    return _row_limit(dtype, MAX_ROWS, os.environ.get(hardware.LOW_PRECISION_ENV))


@functools.cache
def _row_limit(dtype: torch.dtype, max_rows: int, _override: str | None) -> int:
    native = hardware.native_low_precision_matmul(torch.device("cpu"), dtype)
    return min(max_rows, NATIVE_MAX_ROWS) if native else max_rows


# ---- The kernel call ------------------------------------------------------------------------


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``F.linear(x, weight, bias)`` through ``csrc/decode_linear.cpp`` (see :func:`applies`)."""
    (kernel,) = backends.compiled("decode_linear", "cpp", "forward")
    return kernel(x.contiguous(), weight, bias)
