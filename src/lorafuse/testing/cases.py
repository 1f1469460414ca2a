"""pytest building blocks: the backends that run here as parameters, a C++-only mark, call counting, one thread for tiny models."""

from __future__ import annotations

import torch


def available_backends(device="cpu"):
    """Backends that can run on ``device`` in this test session (torch always)."""
    from lorafuse import backends

    found = ["torch"]
    if "cpp" in backends.KERNELS and backends.cpp_available():
        found.append("cpp")
    if backends.triton_runs_on(torch.device(device)):
        found.append("triton")
    return found


def op_cases(*ops: str) -> list:
    """``pytest.param(backend, device)`` for every backend that runs all ``ops`` here.

    The torch reference on CPU always; the C++ kernels on CPU (marked ``cpp``) once built; Triton
    on CPU only under ``TRITON_INTERPRET=1`` (marked ``triton``); on a CUDA machine torch and
    Triton on the GPU (marked ``gpu``), so ``pytest tests/ops -m "not cpp"`` there checks the
    real kernels.
    """
    import pytest

    from lorafuse import backends

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


def needs_cpp(test):
    """Decorator: marker ``cpp``, and a skip where the C++ extension is not built (no compiler)."""
    import pytest

    built = "cpp" in available_backends("cpu")
    return pytest.mark.cpp(pytest.mark.skipif(not built, reason="C++ extension not built")(test))


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` (for the test's duration) so each call appends to the returned list."""
    calls, original = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def single_thread():
    """Generator for an autouse fixture: run a test on one torch thread, then restore.

    Tiny models gain nothing from threads, and on a shared 2-core CI box OpenMP barriers under
    oversubscription made each tiny op ~60x slower (measured: 21 s vs 0.35 s).
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
