"""Shared parameters for the op tests: (backend, device) cases and a fake quantized weight.

Every op test runs once per case from :func:`op_cases`: the torch reference on CPU always; the
C++ kernels on CPU (marked ``cpp``) once built and registered for the op; Triton on CPU only
under ``TRITON_INTERPRET=1`` (marked ``triton``); and, on a CUDA machine, torch and Triton on
the GPU (marked ``gpu``), so ``pytest tests/ops -m "not cpp"`` there checks the real kernels.
(A plain module, not a conftest; it also re-exports the root conftest helpers.)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lorafuse import backends


def _root_conftest():
    """tests/conftest.py by path: other test folders have their own ``conftest.py``, and in a
    full run ``import conftest`` returns whichever of them pytest imported last."""
    name = "_lorafuse_tests_root_conftest"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "conftest.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


assert_close = _root_conftest().assert_close
available_backends = _root_conftest().available_backends
tiny_llama_config = _root_conftest().tiny_llama_config


def op_cases(*ops: str) -> list:
    """``pytest.param(backend, device)`` for every backend that runs all ``ops`` here."""

    def has(backend):
        return all(op in backends.KERNELS.get(backend, ()) for op in ops)

    cases = [pytest.param("torch", "cpu", id="torch-cpu")]
    for b in available_backends("cpu"):
        if b != "torch" and has(b):
            cases.append(pytest.param(b, "cpu", id=f"{b}-cpu", marks=getattr(pytest.mark, b)))
    if torch.cuda.is_available():
        cases.append(pytest.param("torch", "cuda", id="torch-cuda", marks=pytest.mark.gpu))
        if backends.triton_runs_on(torch.device("cuda")) and has("triton"):
            marks = [pytest.mark.gpu, pytest.mark.triton]
            cases.append(pytest.param("triton", "cuda", id="triton-cuda", marks=marks))
    return cases


class FakeQuant:
    """The quantized-weight protocol: ``.shape`` and ``.dequantize(dtype)``, counting calls."""

    def __init__(self, dense: torch.Tensor):
        self._dense = dense
        self.shape = dense.shape
        self.calls = 0

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        self.calls += 1
        return self._dense.to(dtype).clone()
