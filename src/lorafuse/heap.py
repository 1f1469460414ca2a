"""CPU heap policy for training: freed activation-sized buffers reused, not faulted in again.

Allocations of at least :data:`LARGE_BUFFER_BYTES` come from ``csrc/large_buffers.cpp``
(:func:`use_large_buffers`); glibc keeps the rest, with the thresholds
:func:`reuse_freed_buffers_up_to` sets. The heap is the process's, so whoever owns the run applies
the policy (:func:`apply_training_policy` -> :class:`HeapPolicy`, which can revert it), never a
call that patches a model. Why, and what it measured: docs/training.md.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

from lorafuse import _ext

# The largest buffer kept in the heap once freed.
LIMIT_BYTES = 1 << 30
# What a CPU training run asks for: the fused loss's chunk scratch (up to
# ops.cross_entropy.CHUNK_BYTES = 128 MiB with fp32 logits) and every smaller activation:
# SmolLM2-135M bf16, 4 x 512: minor faults per step ~40,000 -> ~35 for +1.5% peak RSS.
TRAINING_BYTES = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_GLIBC_DEFAULT_THRESHOLD = 128 << 10  # both thresholds' documented defaults (mallopt(3))

_threshold = 0  # glibc's mmap threshold as set here (0: untouched)

# Torch CPU allocations from this size up come from the large-buffer allocator: below it the
# blocks are too many and too small for a mapping each (a training step's adapter tensors, rows).
LARGE_BUFFER_BYTES = 1 << 20
LARGE_BUFFERS_ENV = "LORAFUSE_LARGE_BUFFERS"  # "0": keep glibc for every size
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_large_from = 0  # the size the allocator serves from, once installed (0: not installed)


def large_buffers_from() -> int:
    """The allocation size from which lorafuse's allocator serves torch's CPU buffers (0: it is
    not installed in this process)."""
    return _large_from


def huge_pages_allowed() -> bool:
    """Whether the kernel gives transparent huge pages to regions that ask (``madvise`` or
    ``always`` selected)."""
    try:
        with open(_THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def use_large_buffers() -> str | None:
    """Serve torch's large CPU allocations from lorafuse's allocator (see the module), once per
    process. Returns a line for a report, or None where it is off (``$LORAFUSE_LARGE_BUFFERS=0``,
    or the C++ extension unavailable: glibc's heap then serves them, as before)."""
    if os.environ.get(LARGE_BUFFERS_ENV, "1").strip() == "0":
        return None
    from lorafuse import backends

    if not backends.cpp_available():  # warns once; glibc's policy stays
        return None
    global _large_from
    huge = huge_pages_allowed()
    _ext.load_cpp().large_buffers_install(LARGE_BUFFER_BYTES, huge)
    _large_from = LARGE_BUFFER_BYTES
    pages = "2 MiB pages" if huge else "4 KiB pages (transparent huge pages off)"
    return (f"CPU buffers from {LARGE_BUFFER_BYTES >> 20} MiB up: lorafuse's allocator, freed ones "
            f"reused by size, {pages} (lorafuse.heap)")  # fmt: skip


def large_buffer_stats() -> dict:
    """The large-buffer allocator's counters: ``installed``, and where it is, ``live`` / ``cached``
    bytes, ``peak_live`` / ``high_water`` (most bytes alive / mapped at once since the last
    :func:`trim_large_buffers`), ``hits``, ``misses``, ``unmapped``, ``peak_blocks`` (block sizes
    alive at that peak). ``{"installed": False}`` where it never was."""
    if not _ext.is_loaded():
        return {"installed": False}
    return dict(_ext.load_cpp().large_buffers_stats())


def trim_large_buffers() -> int:
    """Unmap the large buffers kept for reuse and restart the peak counters; returns the bytes
    given back (0 where the allocator is not installed)."""
    if not _ext.is_loaded():
        return 0
    module = _ext.load_cpp()
    freed = module.large_buffers_trim()
    module.large_buffers_reset_peak()
    return int(freed)


def threshold() -> int:
    """The mmap threshold set here so far (0: glibc's own policy)."""
    return _threshold


def reuse_freed_buffers_up_to(nbytes: int) -> None:
    """Let glibc reuse a freed buffer of ``nbytes`` instead of unmapping it (see the module)."""
    global _threshold
    if nbytes < _threshold or nbytes > LIMIT_BYTES:
        return
    new = max(64 << 20, 1 << (2 * nbytes - 1).bit_length())  # a power of 2 above 2x
    if _set_glibc_thresholds(new, 4 * new):
        _threshold = new


def _set_glibc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_bytes)
        libc.mallopt(_M_TRIM_THRESHOLD, trim_bytes)
    except (OSError, AttributeError):  # not glibc: its allocator's own policy stays
        return False
    return True


def restore_glibc_defaults() -> None:
    """Put glibc's thresholds back to their documented defaults (128 KiB each). glibc's dynamic
    mmap threshold, which raising it by hand turns off, stays off for the process."""
    global _threshold
    if _threshold and _set_glibc_thresholds(_GLIBC_DEFAULT_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD):
        _threshold = 0


def stop_large_buffers() -> None:
    """New allocations go back to torch's own allocator and the kept buffers are unmapped. The
    allocator object stays registered: buffers it handed out still find their deleter."""
    global _large_from
    if not _large_from:
        return
    module = _ext.load_cpp()
    module.large_buffers_install(0, huge_pages_allowed())
    module.large_buffers_trim()
    _large_from = 0


@dataclass
class HeapPolicy:
    """What :func:`apply_training_policy` set: ``notes`` are lines for the run's report."""

    glibc_threshold: int = 0  # glibc's mmap threshold now (0: untouched)
    large_buffers: bool = False  # lorafuse's allocator serves the large buffers
    notes: list[str] = field(default_factory=list)

    def revert(self) -> None:
        """Undo the policy: glibc's defaults back, torch's allocator serving every size again."""
        revert_training_policy()
        self.glibc_threshold, self.large_buffers = 0, False


def revert_training_policy() -> None:
    """Undo whatever :func:`apply_training_policy` set in this process (a no-op where nothing
    was): what a script that let ``FastLanguageModel.get_peft_model`` apply it calls when done."""
    stop_large_buffers()
    restore_glibc_defaults()


def apply_training_policy(large_buffers: bool = True) -> HeapPolicy:
    """The CPU heap policy for a training run (see the module): glibc keeps freed buffers up to
    :data:`TRAINING_BYTES` and, with ``large_buffers`` and the C++ extension, lorafuse's allocator
    serves those from :data:`LARGE_BUFFER_BYTES` up. Process-wide; :meth:`HeapPolicy.revert`."""
    reuse_freed_buffers_up_to(TRAINING_BYTES)
    policy = HeapPolicy(glibc_threshold=threshold())
    if large_buffers and (line := use_large_buffers()):
        policy.large_buffers = True
        policy.notes.append(line)
    if policy.glibc_threshold:
        policy.notes.append(
            f"glibc keeps freed buffers up to {policy.glibc_threshold >> 20} MiB for reuse "
            "(lorafuse.heap: no page faults per step)"
        )
    return policy
