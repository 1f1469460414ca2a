"""What this machine's processors can do. The bottom layer: imports nothing from lorafuse.

``backends`` (which kernel runs) and ``_ext`` (how the C++ kernels are compiled) both ask here, so
neither imports the other for it.

CPUs differ in the one way that changes numbers and speed: whether bf16/fp16 matrix products run
on native units (AVX-512-BF16 / AMX / AVX-512-FP16) or are emulated (~100x slower than fp32 on an
AVX2 EPYC: 1.2 vs 95 GFLOP/s at 512^3). ``LORAFUSE_CPU_LOW_PRECISION=native|emulated`` forces
either answer, so the test suite runs both branches on any machine (``.ci/run`` does) and a user
can reproduce another machine's choices.
"""

from __future__ import annotations

import functools
import os

import torch

from lorafuse.errors import SettingError

LOW_PRECISION_ENV = "LORAFUSE_CPU_LOW_PRECISION"
LOW_PRECISION_CHOICES = ("auto", "native", "emulated")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def low_precision_override() -> str:
    """``native`` | ``emulated`` | ``auto`` from ``$LORAFUSE_CPU_LOW_PRECISION`` (default auto)."""
    choice = (os.environ.get(LOW_PRECISION_ENV) or "auto").strip().lower()
    if choice not in LOW_PRECISION_CHOICES:
        raise SettingError(
            f"{LOW_PRECISION_ENV}={choice!r} is not one of {', '.join(LOW_PRECISION_CHOICES)}"
        )
    return choice


def native_low_precision_matmul(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether bf16/fp16 matrix products run natively fast on ``device``.

    CUDA: yes. CPU: only with AVX-512-BF16 / AMX (bf16) or AVX-512-FP16 / AMX-FP16 (fp16), unless
    ``$LORAFUSE_CPU_LOW_PRECISION`` says otherwise; elsewhere oneDNN has no low-precision GEMM and
    ATen's fallback is ~100x slower than fp32, so fast paths compute there in fp32.
    """
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16) or device.type != "cpu":
        return True
    override = low_precision_override()
    if override != "auto":
        return override == "native"
    flags = cpu_flags()
    if dtype == torch.bfloat16:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    return bool({"avx512_fp16", "amx_fp16"} & flags)


def matmul_dtype(device: torch.device | str, dtype: torch.dtype) -> torch.dtype:
    """The dtype fast paths use for matrix products of ``dtype`` tensors on ``device``."""
    return dtype if native_low_precision_matmul(device, dtype) else torch.float32


def cpu_capability() -> str:
    """A short name for the CPU's matrix capability: ``amx`` | ``avx512_bf16`` | ``avx2`` | ``other``."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx2" in flags:
        return "avx2"
    return "other"
