"""CPU capability and its override ``$LORAFUSE_CPU_LOW_PRECISION``: what the loader, the ops and the
C++ extension are told, and a clear error for a value that means nothing."""

from __future__ import annotations

import pytest
import torch

from lorafuse import _ext, backends, hardware
from lorafuse.models import checks

CPU = torch.device("cpu")


def test_bad_override_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(hardware.LOW_PRECISION_ENV, "fast")
    with pytest.raises(ValueError, match=r"LORAFUSE_CPU_LOW_PRECISION='fast' is not one of auto"):
        hardware.native_low_precision_matmul(CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="LORAFUSE_CPU_LOW_PRECISION"):
        backends.reconfigure()  # refused before the loaded extension is touched


@pytest.mark.parametrize("value", ["native", " Native ", "emulated", "EMULATED"])
def test_override_forces_the_branch(monkeypatch, value):
    monkeypatch.setenv(hardware.LOW_PRECISION_ENV, value)
    native = value.strip().lower() == "native"
    for dtype in (torch.bfloat16, torch.float16):
        assert hardware.native_low_precision_matmul(CPU, dtype) == native
        assert hardware.matmul_dtype(CPU, dtype) == (dtype if native else torch.float32)
    assert hardware.matmul_dtype(CPU, torch.float32) == torch.float32
    assert checks.choose_dtype(CPU, None)[0] == (torch.bfloat16 if native else torch.float32)
    assert checks.choose_dtype(CPU, "fp32")[0] == torch.float32  # asked for: never overridden


def test_auto_reads_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(hardware.LOW_PRECISION_ENV, raising=False)
    assert hardware.low_precision_override() == "auto"
    flags = hardware.cpu_flags()
    assert hardware.native_low_precision_matmul(CPU, torch.bfloat16) == bool(
        {"avx512_bf16", "amx_bf16"} & flags
    )
    assert backends.describe()["cpu_capability"] == hardware.cpu_capability()


def test_cuda_is_native_whatever_the_override(monkeypatch):
    monkeypatch.setenv(hardware.LOW_PRECISION_ENV, "emulated")
    assert hardware.native_low_precision_matmul("cuda", torch.bfloat16)


@pytest.mark.cpp
def test_reconfigure_reaches_the_loaded_extension(cpu_low_precision):
    if not backends.cpp_available():
        pytest.skip("C++ extension not built here")
    native = cpu_low_precision == "native"
    assert _ext.load_cpp().native_low_precision() == (native, native)
    assert backends.describe()["cpu_low_precision_override"] == cpu_low_precision
