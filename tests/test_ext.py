"""Building, caching and loading the C++ extension, and what happens when it cannot build."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from lorafuse import _ext

pytestmark = pytest.mark.cpp

KERNELS = ("lora_linear", "rms_norm", "swiglu", "rope")


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 240):
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )


def test_builds_and_loads_every_kernel():
    module = _ext.load_cpp()
    for op in KERNELS:
        assert callable(getattr(module, f"{op}_forward")), op
        assert callable(getattr(module, f"{op}_backward")), op
    assert callable(module.cross_entropy_chunk_forward_backward)
    assert (_ext.build_dir() / "BUILD_OK").exists()
    assert _ext.load_cpp() is module  # cached in the process


def test_second_process_reuses_the_cache():
    _ext.load_cpp()  # make sure this version is built
    out = _python(
        """
        from lorafuse import _ext
        _ext._compile = None  # calling the compiler would fail: the build must be reused
        module, directory, compiled = _ext.build()
        print(compiled)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


def test_cache_key_follows_sources_and_flags(tmp_path, monkeypatch):
    key = _ext.build_key()
    for src in _ext.CSRC.iterdir():
        (tmp_path / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(_ext, "CSRC", tmp_path)
    assert _ext.build_key() == key
    (tmp_path / "common.h").write_text((tmp_path / "common.h").read_text() + "\n// edit\n")
    assert _ext.build_key() != key
    monkeypatch.setenv("LORAFUSE_CACHE", str(tmp_path / "c"))
    assert _ext.build_dir().parent == tmp_path / "c" / "ext"


def test_lock_serialises_builders(tmp_path):
    """A second builder of the same (unbuilt) directory waits for the first one's lock."""
    env = {"CXX": str(tmp_path / "no-such-c++"), "LORAFUSE_CACHE": str(tmp_path / "cache")}
    code = (
        "import time; from lorafuse import _ext\n"
        "try:\n    _ext.build()\nexcept _ext.ExtensionUnavailable as err:\n"
        "    print(time.time(), err)"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAFUSE_CACHE", env["LORAFUSE_CACHE"])
        directory = _ext.build_dir()
    with _ext._file_lock(directory.parent / f"{directory.name}.lock"):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
            env={**os.environ, **env},
        )  # fmt: skip
        time.sleep(3.0)  # it imports torch, then blocks on the lock
        released = time.time()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    finished, reason = out.split(" ", 1)
    assert float(finished) >= released  # it went on only after we let go
    assert "not found" in reason


def test_build_error_reason_is_the_compiler_error_line():
    log = (
        "Error building extension 'lorafuse_cpp': [1/8] c++ -MMD -MF common.o.d ...\n"
        "In file included from /x/rope.cpp:9:\n"
        "/x/common.h:35:28: error: no matching function for call to 'f(int)'\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    assert _ext._first_error_line(log).startswith("/x/common.h:35:28: error: no matching")


MISSING_COMPILER = """
    import warnings
    import torch
    from lorafuse import _ext
    from lorafuse.ops.lora_linear import lora_linear, lora_linear_reference
    try:
        _ext.load_cpp()
        print("LOADED")
    except _ext.ExtensionUnavailable as err:
        print("UNAVAILABLE", err)
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    a, b = torch.randn(2, 8), torch.randn(5, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ys = [lora_linear(x, w, None, a, b, 2.0, backend="cpp") for _ in range(3)]
    loud = [w for w in caught if "C++ CPU kernels unavailable" in str(w.message)]
    print("WARNINGS", len(loud))
    ref = lora_linear_reference(x, w, None, a, b, 2.0)
    print("MATCH", all(torch.allclose(y, ref, atol=1e-6) for y in ys))
"""


def test_missing_compiler_warns_once_and_runs_torch(tmp_path):
    env = {"CXX": str(tmp_path / "no-such-c++"), "LORAFUSE_CACHE": str(tmp_path / "cache")}
    out = _python(MISSING_COMPILER, env)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert "not found" in lines["UNAVAILABLE"] and "no-such-c++" in lines["UNAVAILABLE"]
    assert lines["WARNINGS"] == "1"
    assert lines["MATCH"] == "True"
    assert "lorafuse: compiling the C++ CPU kernels" in out.stderr  # a first use says it builds


def test_build_ext_cli_reports_cache_and_fails_clearly(tmp_path):
    ok = _python("from lorafuse.commands import main; raise SystemExit(main(['build-ext']))")
    assert ok.returncode == 0, ok.stderr
    assert str(_ext.build_dir()) in ok.stdout
    env = {"CXX": "/nonexistent/c++", "LORAFUSE_CACHE": str(tmp_path / "cache")}
    bad = _python("from lorafuse.commands import main; raise SystemExit(main(['build-ext']))", env)
    assert bad.returncode == 2
    assert "cannot build the C++ kernels" in bad.stderr and "/nonexistent/c++" in bad.stderr
