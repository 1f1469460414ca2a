"""The bench's process machinery, shared with the image bench (:mod:`lorafuse.bench.image`): a
fresh interpreter per run, its result back as JSON, and peak memory measured inside it."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile

from lorafuse import files
from lorafuse.errors import LorafuseError


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_cpu_peak() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Peak memory above the moment :meth:`start` is called (see :mod:`lorafuse.bench`)."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device

    def start(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
        else:
            if not _reset_cpu_peak():
                raise RuntimeError("cannot reset VmHWM through /proc/self/clear_refs")
            self.base = _status_kib("VmRSS") * 1024

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return self.torch.cuda.max_memory_allocated() - self.base
        return _status_kib("VmHWM") * 1024 - self.base

    def peak_total_bytes(self) -> int:
        """The whole peak since :meth:`start`, weights included: the process's RSS high-water
        mark (interpreter and libraries too), or on CUDA every allocated byte."""
        if self.device.type == "cuda":
            return self.torch.cuda.max_memory_allocated()
        return _status_kib("VmHWM") * 1024


class _MallInfo2(ctypes.Structure):  # <malloc.h>'s struct mallinfo2 (glibc >= 2.33)
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]  # fmt: skip


def heap_bytes() -> dict | None:
    """glibc malloc's heap right now, over all its arenas, plus the blocks of lorafuse's
    large-buffer allocator where it is installed (:mod:`lorafuse.heap`): ``mapped`` (the arenas,
    the chunks glibc mmapped, the large blocks), ``in_use`` (allocated in those) and ``free``
    (freed, kept mapped for reuse: resident wherever it was touched); None where the C library
    has no ``mallinfo2``.

    After training steps, ``free`` is what the steps' transient buffers left behind: glibc places
    them in different holes from step to step, so the peak RSS holds more than they need at once
    (fragmentation)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    out = {"mapped": info.arena + info.hblkhd, "in_use": info.uordblks + info.hblkhd,
           "free": info.fordblks}  # fmt: skip
    from lorafuse import heap

    large = heap.large_buffer_stats()  # torch's large buffers, where lorafuse's allocator has them
    if large["installed"]:
        out["mapped"] += large["live"] + large["cached"]
        out["in_use"] += large["live"]
        out["free"] += large["cached"]
    return out


def process_bytes(device) -> int:
    """RSS of this worker before any model exists, its libraries imported (CPU; 0 on CUDA, where
    the total peak counts allocations only): what every configuration pays regardless."""
    if device.type == "cuda":
        return 0
    import peft  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    from lorafuse import patching  # noqa: F401

    return _status_kib("VmRSS") * 1024


def release_free_memory() -> None:
    """Collect garbage and hand free heap pages back to the OS (glibc's ``malloc_trim``), so the
    RSS the steps start from holds what the model keeps, not what building it left free."""
    from lorafuse import heap

    gc.collect()
    heap.trim_large_buffers()  # and restart its peak: the steps' own is what it reports after
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed pages may stay resident; nothing to do
        pass


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


# glibc malloc tunables the image bench runs every worker under (``spawn(..., env=)``): never
# mmap a chunk (so no munmap on free), never trim the heap top, one arena. With glibc's
# defaults, freed activation buffers go back to the kernel and are faulted in again the next step
# (~209k minor faults per SD1.5 step at 128 px: 0.3-0.7 s of system time; `minflt` per step
# in the bench's --json runs).
# The LLM bench keeps glibc's defaults: there these settings raised both sides' peak memory by
# ~20% at 4 x 512 (smollm2-135m bf16: stock 5152 vs ~4300 MiB) and pushed stock past this
# 23 GiB box at 1 x 8192 (killed), so its memory figures would no longer be the user's.
STEADY_MALLOC = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
    "MALLOC_TOP_PAD_": str(2**26),
    "MALLOC_ARENA_MAX": "1",
}


def spawn(spec: dict, module: str = "lorafuse.bench", env: dict | None = None) -> dict:
    """Run one configuration in a fresh interpreter (``python -m module --worker JSON``, the
    image bench uses its own module), with ``env`` added to its environment; its result comes
    back as JSON."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [
            sys.executable,
            "-m",
            module,
            "--worker",
            json.dumps({**spec, "out": out.name}),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}
        )
        if proc.returncode != 0:
            raise LorafuseError(
                f"{spec['config']} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        return json.load(out)


def worker_entry(payload: str, run) -> int:
    """The worker side of :func:`spawn`: run ``spec`` with ``run`` (the LLM bench's
    :func:`lorafuse.bench.llm.run_worker`, the image bench's own) and write the result to
    ``spec['out']``."""
    spec = json.loads(payload)
    out = run(spec)
    with open(spec["out"], "w") as f:
        json.dump(out, f)
    return 0


def write_json(path: str, data: dict) -> None:
    files.write_json(os.path.abspath(path), data)
