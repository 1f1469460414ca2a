"""Helpers shared by the Triton kernels: device checks, block sizes, dot precision.

Kernels run on CUDA tensors; on CPU tensors only under ``TRITON_INTERPRET=1`` (tests), and that
variable must be set before the kernel modules are imported (``@triton.jit`` reads it when it
decorates). Nothing here falls back silently: a call that cannot run raises.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lorafuse import backends

# Triton's tl.dot needs every block dimension >= 16 on the GPU.
MIN_DOT_BLOCK = 16

# Fixed when this module is imported, exactly like @triton.jit's own interpret-or-compile choice.
INTERPRETED = tl.constexpr(backends.triton_interpreting())

# Kernels here call only Triton builtins and the jit helpers below, never Triton's own jit-written
# library functions (tl.sum, tl.max, tl.zeros, tl.sigmoid, tl.cdiv): those were decorated when
# triton was first imported, and if that was before TRITON_INTERPRET=1 was set (any earlier
# import of transformers/torch._dynamo can do it) the interpreter refuses to call them. The
# helpers compile to exactly what the library versions do (tl.sum is tl.reduce with an add).


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def fsum(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, _add)


@triton.jit
def fmax(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, _maximum)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def dot_acc(a, b, acc, PREC: tl.constexpr):
    """``acc + a·b`` with fp32 accumulation.

    Under the interpreter (Triton 3.9) tl.dot mis-reads bf16 operands, so there the operands are
    upcast first: bf16/fp16 products are exact in fp32, so the sums are the same ones.
    """
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` rounding to nearest-even, as the GPU's conversion does.

    The interpreter truncates fp32 -> bf16 (Triton 3.9); there the value is first rounded to the
    nearest bf16 in fp32 bits (ties to even), so the truncating cast that follows is exact.
    """
    if INTERPRETED and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    return x.to(DTYPE)


def check_device(op: str, *tensors: torch.Tensor | None) -> torch.device:
    """The common device of ``tensors``; raises when Triton cannot run there."""
    present = [t for t in tensors if t is not None]
    device = present[0].device
    for t in present[1:]:
        if t.device != device:
            raise ValueError(f"lorafuse.triton.{op}: tensors on {device} and {t.device}")
    if device.type == "cpu" and not backends.triton_interpreting():
        raise RuntimeError(
            f"lorafuse.triton.{op}: CPU tensors run only with TRITON_INTERPRET=1 set before "
            "lorafuse.triton is imported (tests); use a CUDA device"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"lorafuse.triton.{op}: unsupported device {device}")
    return device


def check_contiguous(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"lorafuse.triton.{op}: {name} {tuple(t.shape)} must be contiguous")


def interpreted(device: torch.device) -> bool:
    return device.type == "cpu"


def pow2_at_least(n: int, floor: int = MIN_DOT_BLOCK) -> int:
    return max(floor, triton.next_power_of_2(max(1, int(n))))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for fp32 operands, following torch's own TF32 switch.

    torch leaves ``torch.backends.cuda.matmul.allow_tf32`` off by default, so fp32 products stay
    IEEE there; doing the same keeps fp32 results within rounding of the torch reference.
    bf16/fp16 operands ignore this.
    """
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_for_rows(device: torch.device, n_rows: int, per_sm: int = 4) -> int:
    """How many persistent programs to launch for a per-row reduction (e.g. RMSNorm's dw)."""
    if device.type != "cuda":
        return max(1, min(n_rows, 4))  # interpreter: few programs, so few numpy loops
    return max(1, min(n_rows, sm_count(device.index or 0) * per_sm))
