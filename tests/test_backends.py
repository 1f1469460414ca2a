"""backends.select: the one place that chooses kernels, and the record of every choice it made."""

from __future__ import annotations

import pytest
import torch

from lorafuse import backends, hardware


def test_auto_on_cuda_keeps_torch_until_triton_is_measured_faster(monkeypatch):
    # TRITON_DEFAULT is empty until benchmarks/ops/gpu_all.py (scripts/gpu_check.sh) measures an op
    # faster; auto then answers torch on CUDA even where Triton runs, and says why.
    monkeypatch.setattr(backends, "triton_runs_on", lambda device: True)
    assert backends.TRITON_DEFAULT == set()
    for op in sorted(backends.KERNELS["triton"]):
        assert backends.select(op, "cuda") == "torch"
        assert (
            backends.choices()[f"{op} (cuda)"]
            == "torch: auto: Triton not measured faster on GPU yet"
        )
    assert backends.select("rms_norm", "cuda", "triton") == "triton"  # asked for: it runs
    monkeypatch.setattr(backends, "TRITON_DEFAULT", {"rms_norm"})
    assert backends.select("rms_norm", "cuda") == "triton"


def test_unsupported_call_runs_torch_with_one_warning(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(backends, "cpp_ready", lambda op: True)
    with pytest.warns(RuntimeWarning, match="odd dtypes; the cpp kernel cannot take it"):
        assert backends.select("rms_norm", "cpu", "cpp", unsupported="odd dtypes") == "torch"
    assert backends.choices()["rms_norm (cpu)"] == "torch: odd dtypes"
    assert backends.select("rms_norm", "cpu", "torch", unsupported="odd dtypes") == "torch"


def test_describe_lists_every_choice_made():
    backends.select("swiglu", torch.device("cpu"), "torch")
    backends.record("nf4_dequantize", "cpu", "lorafuse", "test")
    choices = backends.describe()["choices"]
    assert choices["swiglu (cpu)"] == "torch: requested"
    assert choices["nf4_dequantize (cpu)"] == "lorafuse: test"


def test_bad_backend_requests_are_user_errors(monkeypatch):
    """A bad ``LORAFUSE_KERNELS`` or an impossible backend ends as one line in the CLI: both are
    :class:`LorafuseError` (and still the ``ValueError`` / ``RuntimeError`` they were)."""
    from lorafuse.errors import LorafuseError

    monkeypatch.setenv(backends.ENV_VAR, "cuda")
    with pytest.raises(LorafuseError, match="LORAFUSE_KERNELS='cuda' is not one of") as info:
        backends.requested()
    assert isinstance(info.value, ValueError)
    assert issubclass(backends.BackendError, LorafuseError)
    assert issubclass(backends.BackendError, RuntimeError)


def test_cpu_variant_is_the_widest_this_cpu_runs(monkeypatch):
    monkeypatch.delenv(backends.CPU_VARIANT_ENV, raising=False)
    monkeypatch.setattr(hardware, "is_arm", lambda: False)
    for level, runs in [("avx512", ("default", "avx2", "avx512")), ("avx2", ("default", "avx2")),
                        ("default", ("default",))]:  # fmt: skip
        monkeypatch.setattr(hardware, "isa_level", lambda level=level: level)
        assert hardware.cpu_variants() == runs
        assert hardware.cpu_variant() == runs[-1]
    monkeypatch.setattr(hardware, "is_arm", lambda: True)
    assert hardware.cpu_variant() == "default"


def test_forced_cpu_variant_and_its_errors(monkeypatch):
    monkeypatch.setattr(hardware, "is_arm", lambda: False)
    monkeypatch.setattr(hardware, "isa_level", lambda: "avx2")
    monkeypatch.setenv(backends.CPU_VARIANT_ENV, "DEFAULT")
    assert hardware.cpu_variant() == "default"
    monkeypatch.setenv(backends.CPU_VARIANT_ENV, "avx512")  # would be an illegal instruction
    with pytest.raises(backends.CpuVariantError, match="avx512 cannot run on this CPU"):
        hardware.cpu_variant()
    monkeypatch.setenv(backends.CPU_VARIANT_ENV, "sve")
    with pytest.raises(backends.CpuVariantError, match="'sve' is not one of auto, default"):
        hardware.cpu_variant()


def test_report_and_describe_name_the_loaded_variant(monkeypatch):
    from lorafuse import _ext
    from lorafuse.patching.report import PatchReport

    monkeypatch.setattr(_ext, "_origin", "avx2 (prebuilt)")
    assert backends.cpp_variant() == "avx2 (prebuilt)"
    assert "  C++ kernels: avx2 (prebuilt)" in str(PatchReport()).splitlines()
    assert PatchReport().to_dict()["cpp_variant"] == "avx2 (prebuilt)"
