"""Shared test fixtures. The helpers themselves live in :mod:`lorafuse.testing`, a real module,
so that test folders with their own conftest.py can never shadow them."""

from __future__ import annotations

import os

import pytest
import torch

from lorafuse import backends, hardware
from lorafuse.testing import assert_close, available_backends, tiny_llama_config  # noqa: F401

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# The two CPU branches that change numbers (lorafuse.hardware): bf16/fp16 products on native units
# (AVX-512-BF16 / AMX: the loader picks bf16, the C++ kernels multiply in bf16) or emulated (AVX2:
# the loader picks fp32, the kernels multiply bf16 tensors in fp32). Forcing each one lets every
# machine run both, so the suite holds on AVX2, AVX-512-BF16 and AMX alike.
CPU_BRANCHES = ("native", "emulated")


def _set_low_precision(value: str | None) -> None:
    if value is None:
        os.environ.pop(hardware.LOW_PRECISION_ENV, None)
    else:
        os.environ[hardware.LOW_PRECISION_ENV] = value
    backends.reconfigure()  # the loaded C++ extension follows (the Python side reads it per call)


@pytest.fixture(params=CPU_BRANCHES)
def cpu_low_precision(request):
    """Runs the test once per CPU branch with ``$LORAFUSE_CPU_LOW_PRECISION`` set to it (restored
    after). Returns the branch. Parametrize it indirectly to pick branches for some cases only."""
    before = os.environ.get(hardware.LOW_PRECISION_ENV)
    _set_low_precision(request.param)
    try:
        yield request.param
    finally:
        _set_low_precision(before)


@pytest.fixture(autouse=True)
def _extension_follows_the_environment():
    """After each test, the C++ extension's branch matches the environment again, also when a test
    set ``$LORAFUSE_CPU_LOW_PRECISION`` with monkeypatch (restored before this runs) while the
    extension loaded: otherwise its choice would leak into every later test."""
    yield
    backends.reconfigure()


@pytest.fixture
def close():
    return assert_close


@pytest.fixture
def ieee_fp32_convs():
    """cuDNN runs fp32 convolutions in TF32 by default (10-bit mantissa); fp32 comparisons of
    convolutions need IEEE fp32 on both sides. Nothing changes on CPU."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before
