"""Shared parameters for the op tests: (backend, device) cases and a fake quantized weight.

Every op test runs once per case from :func:`op_cases`: the torch reference on CPU always; the
C++ kernels on CPU (marked ``cpp``) once built and registered for the op; Triton on CPU only
under ``TRITON_INTERPRET=1`` (marked ``triton``); and, on a CUDA machine, torch and Triton on
the GPU (marked ``gpu``), so ``pytest tests/ops -m "not cpp"`` there checks the real kernels.
(A plain module, not a conftest; it re-exports the helpers of :mod:`lorafuse.testing`.)
"""

from __future__ import annotations

import pytest
import torch

from lorafuse import backends
from lorafuse.testing import assert_close, available_backends, tiny_llama_config  # noqa: F401


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
