"""backends.select: the one place that chooses kernels, and the record of every choice it made."""

from __future__ import annotations

import pytest
import torch

from lorafuse import backends


def test_auto_on_cuda_keeps_torch_until_triton_is_measured_faster(monkeypatch):
    # TRITON_DEFAULT is empty until benchmarks/bench_gpu.py (scripts/gpu_check.sh) measures an op
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
