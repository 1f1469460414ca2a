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
import platform

import torch

from lorafuse.errors import LorafuseError, SettingError

LOW_PRECISION_ENV = "LORAFUSE_CPU_LOW_PRECISION"
LOW_PRECISION_CHOICES = ("auto", "native", "emulated")


def parse_cpuinfo(text: str) -> frozenset[str]:
    """The first ``flags`` (x86) or ``Features`` (ARM: asimd, sve, bf16, i8mm...) line's words."""
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("flags", "Features") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none). What the kernel
    reports for the host: emulators and some VMs differ from the CPU that runs us, so the choice
    of instruction set asks CPUID instead (:func:`isa_level`)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return frozenset()


def is_arm() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


# torch.backends.cpu.get_cpu_capability() (CPUID, as ATen dispatches) -> the widest lorafuse
# variant that runs: "AVX512" needs F/BW/VL/DQ, "AVX2" AVX2+FMA; anything else (DEFAULT, NO AVX,
# SVE256, VSX...) runs the baseline.
_TORCH_CAPABILITY = {"AVX512": "avx512", "AVX2": "avx2"}


def isa_level() -> str:
    """``avx512`` | ``avx2`` | ``default``: the widest x86 vector level this CPU runs, asked of
    CPUID through torch (right under qemu, VMs and containers whose /proc/cpuinfo misreports).
    Note torch lowers it where ``$ATEN_CPU_CAPABILITY`` asks for less."""
    if is_arm():
        return "default"
    return _TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), "default")


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
    if is_arm():  # ARMv8.6 BF16 (Features: bf16) / ARMv8.2 FP16 arithmetic (asimdhp)
        return ("bf16" if dtype == torch.bfloat16 else "asimdhp") in flags
    if dtype == torch.bfloat16:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    return bool({"avx512_fp16", "amx_fp16"} & flags)


def matmul_dtype(device: torch.device | str, dtype: torch.dtype) -> torch.dtype:
    """The dtype fast paths use for matrix products of ``dtype`` tensors on ``device``."""
    return dtype if native_low_precision_matmul(device, dtype) else torch.float32


def cpu_capability() -> str:
    """A short name for the CPU's matrix capability: ``amx`` | ``avx512_bf16`` | ``avx2`` |
    ``arm_sve`` | ``arm_bf16`` | ``arm_neon`` | ``other``."""
    flags = cpu_flags()
    if is_arm():
        return "arm_sve" if "sve" in flags else "arm_bf16" if "bf16" in flags else "arm_neon"
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx2" in flags:
        return "avx2"
    return "other"


# The C++ variants (lorafuse._ext compiles one module each), narrowest first. Chosen here, at the
# bottom, because _ext (which loads one) and backends (which reports it) both ask.
VARIANTS = ("default", "avx2", "avx512")
CPU_VARIANT_ENV = "LORAFUSE_CPU_CAPABILITY"


class CpuVariantError(LorafuseError):
    """``$LORAFUSE_CPU_CAPABILITY`` names a variant that is unknown or that this CPU cannot run."""


def cpu_variants() -> tuple[str, ...]:
    """The C++ variants this CPU runs, narrowest first (``default`` only, off x86)."""
    if is_arm() or isa_level() == "default":
        return ("default",)
    order = VARIANTS
    return order[: order.index(isa_level()) + 1]


def cpu_variant() -> str:
    """The C++ variant to load: ``$LORAFUSE_CPU_CAPABILITY`` if set (``auto`` = unset), else the
    widest this CPU runs. A forced variant the CPU cannot run raises :class:`CpuVariantError`
    here, before anything is loaded: loading it would die of an illegal instruction."""
    runs = cpu_variants()
    forced = (os.environ.get(CPU_VARIANT_ENV) or "auto").strip().lower()
    if forced == "auto":
        return runs[-1]
    if forced not in VARIANTS:
        raise CpuVariantError(
            f"{CPU_VARIANT_ENV}={forced!r} is not one of auto, {', '.join(VARIANTS)}"
        )
    if forced not in runs:
        raise CpuVariantError(
            f"{CPU_VARIANT_ENV}={forced} cannot run on this CPU (torch reports "
            f"{torch.backends.cpu.get_cpu_capability()}; it runs {', '.join(runs)})"
        )
    return forced


def default_device() -> torch.device:
    """The device lorafuse uses when none is given (loading, ``lorafuse train``, ``train-image``,
    the UI's estimate): CUDA where torch sees a GPU, else the CPU. Apple's MPS only when asked
    for (``device="mps"``): lorafuse's fast kernels are C++ (CPU) and Triton (CUDA), so an MPS
    run is stock PyTorch throughout."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
