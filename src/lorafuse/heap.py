"""glibc heap policy for CPU training: keep freed activation-sized buffers for reuse.

glibc serves every allocation above its mmap threshold (at most 32 MiB when left to itself) with
a fresh ``mmap`` and unmaps it when freed, and trims free memory at the heap top; the next step
then faults the same pages in again, each zero-filled by the kernel. A training step allocates
and frees the same activation buffers every time, so with the defaults a SmolLM2-135M bf16 step
at 4 x 512 took ~40,000 minor page faults (stock PEFT: ~530,000), and each NF4 dequantisation of
a 32 MiB weight cost 29 ms against 4 ms into a reused buffer (``benchmarks/bench_nf4.py``).

:func:`reuse_freed_buffers_up_to` raises the mmap threshold above a given size (and the trim
threshold to 4x it), so freed buffers up to that size stay in the heap for the next allocation.
Process-wide, only ever raised, a no-op where the C library is not glibc. Peak memory does not
grow when the same buffers come back each step; up to the trim threshold of free heap stays mapped
between steps. Buffers allocated and freed between longer-lived ones fragment the heap instead
(NF4's transient dense weights: +530 MiB peak on a Llama-3.2-1B step), so those are kept in
:func:`lorafuse.ops.weights.dense_buffer` rather than left to the heap.
"""

from __future__ import annotations

import ctypes

# The largest buffer kept in the heap once freed.
LIMIT_BYTES = 1 << 30
# What patch_peft_model and train-image ask for on CPU: the fused loss's chunk scratch (up to
# ops.cross_entropy.CHUNK_BYTES = 128 MiB with fp32 logits) and every smaller activation. Ad-hoc
# probe (SmolLM2-135M bf16, 4 x 512, 2 threads): minor faults per step ~40,000 -> ~35, peak RSS
# 1964 -> 1987 MiB (32 MiB asked) / 1993 MiB (128 MiB asked).
TRAINING_BYTES = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>

_threshold = 0  # glibc's mmap threshold as set here (0: untouched)


def threshold() -> int:
    """The mmap threshold set here so far (0: glibc's own policy)."""
    return _threshold


def reuse_freed_buffers_up_to(nbytes: int) -> None:
    """Let glibc reuse a freed buffer of ``nbytes`` instead of unmapping it (see the module)."""
    global _threshold
    if nbytes < _threshold or nbytes > LIMIT_BYTES:
        return
    new = max(64 << 20, 1 << (2 * nbytes - 1).bit_length())  # a power of 2 above 2x
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, new)
        libc.mallopt(_M_TRIM_THRESHOLD, 4 * new)
    except (OSError, AttributeError):  # not glibc: its allocator's own policy stays
        return
    _threshold = new
