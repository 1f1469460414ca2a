"""Shared test fixtures. The helpers themselves live in :mod:`lorafuse.testing`, a real module,
so that test folders with their own conftest.py can never shadow them."""

from __future__ import annotations

import os
import sys

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


def _reopened(stream, fd: int):
    """A usable text stream on a copy of ``fd`` when ``stream`` was closed, else ``stream``."""
    return open(os.dup(fd), "w", buffering=1) if stream is None or stream.closed else stream


_closed_streams: list[str] = []
_capture_manager = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    """A library that wraps the process's real stdout/stderr and lets the wrapper close them (a CI
    run once ended so, "lost sys.stderr", naming no test) would silence pytest and end the run:
    reopen them on copies of fds 1 and 2, and name the test in the summary."""
    broken = [
        n for n in ("__stdout__", "__stderr__") if getattr(sys, n) is None or getattr(sys, n).closed
    ]
    if not broken:
        return
    _closed_streams.append(f"{report.nodeid} ({report.when}) closed sys.{', sys.'.join(broken)}")
    sys.__stdout__, sys.__stderr__ = _reopened(sys.__stdout__, 1), _reopened(sys.__stderr__, 2)
    sys.stdout, sys.stderr = _reopened(sys.stdout, 1), _reopened(sys.stderr, 2)
    # pytest's capture swaps back the streams it saved at start: give it the reopened ones
    capturing = getattr(_capture_manager, "_global_capturing", None)
    for capture, good in ((getattr(capturing, "out", None), sys.__stdout__),
                          (getattr(capturing, "err", None), sys.__stderr__)):  # fmt: skip
        saved = getattr(capture, "syscapture", capture)
        if getattr(saved, "_old", None) is not None and saved._old.closed:
            saved._old = good


@pytest.hookimpl(trylast=True)  # after the terminal reporter registered itself
def pytest_configure(config):
    """pytest's own output goes to a private copy of fd 1, which no test or library can close."""
    global _capture_manager
    _capture_manager = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    tw_file = getattr(getattr(reporter, "_tw", None), "_file", None)
    if tw_file is sys.__stdout__ and sys.__stdout__ is not None:
        reporter._tw._file = open(os.dup(sys.__stdout__.fileno()), "w", buffering=1,
                                  encoding=sys.__stdout__.encoding, errors="replace")  # fmt: skip


def pytest_terminal_summary(terminalreporter):
    for line in _closed_streams:
        terminalreporter.write_line(f"WARNING: {line}; reopened", red=True)


# Importing OpenVINO changes the process for the tests after it: pytest's capture around an
# in-process server thread then fails ("I/O operation on closed file"; tests/evaluation's lm-eval
# test, seen in CI). Its tests import it lazily and run last.
RUN_LAST = ("tests/export/test_openvino.py",)


def pytest_collection_modifyitems(config, items):
    last = [item for item in items if item.nodeid.startswith(RUN_LAST)]
    if last:
        items[:] = [item for item in items if not item.nodeid.startswith(RUN_LAST)] + last


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
