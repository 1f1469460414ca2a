"""CPU capability and its override ``$LORAFUSE_CPU_LOW_PRECISION``: what the loader, the ops and the
C++ extension are told, and a clear error for a value that means nothing."""

from __future__ import annotations

import pytest
import torch

from lorafuse import _ext, backends, hardware
from lorafuse.models import preflight

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
    assert preflight.choose_dtype(CPU, None)[0] == (torch.bfloat16 if native else torch.float32)
    assert preflight.choose_dtype(CPU, "fp32")[0] == torch.float32  # asked for: never overridden


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


ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
lrcpc dcpop sha3 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm \
svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""
X86_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16\nbugs\t\t: none\n"


def test_cpuinfo_reads_arm_features_and_x86_flags():
    arm = hardware.parse_cpuinfo(ARM_CPUINFO)
    assert {"asimd", "sve", "bf16", "i8mm", "asimdhp"} <= arm and "flags" not in arm
    assert hardware.parse_cpuinfo(X86_CPUINFO) == {"fpu", "sse2", "avx2", "fma", "avx512f",
                                                   "avx512_bf16"}  # fmt: skip
    assert hardware.parse_cpuinfo("processor\t: 0\n") == frozenset()


def test_arm_bf16_counts_as_native(monkeypatch):
    monkeypatch.delenv(hardware.LOW_PRECISION_ENV, raising=False)
    monkeypatch.setattr(hardware, "is_arm", lambda: True)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: hardware.parse_cpuinfo(ARM_CPUINFO))
    assert hardware.native_low_precision_matmul(CPU, torch.bfloat16)
    assert hardware.cpu_capability() == "arm_sve"
    assert hardware.isa_level() == "default"
    pi4 = "Features\t: fp asimd evtstrm crc32 cpuid\n"  # Cortex-A72: NEON only
    monkeypatch.setattr(hardware, "cpu_flags", lambda: hardware.parse_cpuinfo(pi4))
    assert not hardware.native_low_precision_matmul(CPU, torch.bfloat16)
    assert hardware.cpu_capability() == "arm_neon"


def test_isa_level_asks_cpuid_through_torch():
    # torch reads CPUID (right under qemu, where /proc/cpuinfo is the host's)
    expected = {"AVX512": "avx512", "AVX2": "avx2"}.get(
        torch.backends.cpu.get_cpu_capability(), "default"
    )
    assert hardware.isa_level() == (expected if not hardware.is_arm() else "default")


@pytest.mark.parametrize("cuda", [False, True])
def test_one_default_device_everywhere(monkeypatch, cuda):
    """Loading, LLM training, image training and the UI's estimate take the device from one rule
    (hardware.default_device): CUDA where torch sees a GPU, else the CPU, never MPS unasked."""
    from lorafuse.image.trainer import _device
    from lorafuse.train.distributed import _pick_device
    from lorafuse.ui.estimate import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)  # an Apple machine
    want = "cuda" if cuda else "cpu"
    assert hardware.default_device().type == want
    assert preflight.choose_device(None).type == want
    assert _pick_device(0, None).type == want
    assert _device(None).type == want
    assert default_device() == want
    assert preflight.choose_device("mps").type == "mps"  # asked for: as given
