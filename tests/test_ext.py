"""Building, caching and loading the C++ extension, and what happens when it cannot build."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lorafuse import _ext, hardware

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


# --- per-capability variants -------------------------------------------------------------------

# Functions compiled for AVX-512 by their own `target` attribute and called only after
# `__builtin_cpu_supports` says yes (nf4.h: nf4_avx512_available): allowed in every variant.
# the NF4 kernels, and the decode engine's GEMVs (csrc/decode_gemv.cpp picks them by cpuid)
RUNTIME_CHECKED = ("dequantize_blocks_avx512", "scaled_code", "block_absmaxes", "nf4_dot_block",
                   "nf4_dot_rows", "gemv512::", "gemv256::", "gemv_avx512", "gemv_avx2")  # fmt: skip
_PREFIXES = {"26", "2e", "36", "3e", "64", "65", "67"}  # legal before VEX/EVEX in 64-bit code


def wide_instructions(so: Path) -> dict[str, dict[str, int]]:
    """Per function of ``so``: counts of EVEX (AVX-512: first opcode byte 0x62 in 64-bit mode)
    and VEX (AVX/AVX2: 0xc4/0xc5) encoded instructions, read from ``objdump -d``'s raw bytes."""
    out = subprocess.run(["objdump", "-d", "-C", "--no-addresses", str(so)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    found: dict[str, dict[str, int]] = {}
    function = "?"
    for line in out.splitlines():
        if line.startswith("<") and line.endswith(">:"):
            function = line[1:-2]
            continue
        parts = line.strip("\t").split("\t")  # "<bytes>\t<instruction>"
        if len(parts) < 2 or not parts[1].strip():  # continuation of a long instruction's bytes
            continue
        raw = parts[0].split()
        while raw and raw[0] in _PREFIXES:
            raw = raw[1:]
        kind = {"62": "evex", "c4": "vex", "c5": "vex"}.get(raw[0] if raw else "")
        if kind:
            counts = found.setdefault(function, {"evex": 0, "vex": 0})
            counts[kind] += 1
    return found


def leaks(so: Path, kinds: tuple[str, ...]) -> dict[str, dict[str, int]]:
    return {
        fn: counts
        for fn, counts in wide_instructions(so).items()
        if any(counts[k] for k in kinds) and not any(name in fn for name in RUNTIME_CHECKED)
    }


def test_variants_have_their_own_names_flags_and_cache():
    names = {_ext.module_name(v) for v in _ext.VARIANTS}
    assert len(names) == len(_ext.VARIANTS)
    dirs = {_ext.build_dir(v) for v in _ext.VARIANTS}
    assert len(dirs) == len(_ext.VARIANTS)
    assert not any(f.startswith("-m") for f in _ext.compile_flags("default"))
    assert "-mavx512f" not in _ext.compile_flags("avx2")
    with pytest.raises(ValueError, match="unknown CPU variant 'sse9'"):
        _ext.compile_flags("sse9")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
@pytest.mark.parametrize("variant", ["default", "avx2"])
def test_narrow_variants_carry_no_wider_instructions(variant):
    """The classic leak: an inline helper or static initialiser compiled under wide flags. Builds
    the variant (cached like the native one) and disassembles it: no AVX-512 (EVEX) in `avx2`, no
    AVX at all (VEX or EVEX) in `default`, outside the run-time-checked functions."""
    if hardware.is_arm():
        pytest.skip("x86 variants")
    _, directory, _ = _ext.build(variant)
    so = directory / f"{_ext.module_name(variant)}.so"
    found = wide_instructions(so)
    assert any(any(n in fn for n in RUNTIME_CHECKED) and c["evex"] for fn, c in found.items()), (
        "the scan found no AVX-512 even in the run-time-checked NF4 kernels: it is blind"
    )
    kinds = ("evex",) if variant == "avx2" else ("evex", "vex")
    assert leaks(so, kinds) == {}
    if variant == "avx2":  # the flags took: AVX2 code is there
        assert sum(c["vex"] for c in found.values()) > 1000


def test_forced_variant_loads_and_is_named(tmp_path):
    """LORAFUSE_CPU_CAPABILITY picks the variant a process loads; describe() names it."""
    out = _python(
        """
        from lorafuse import _ext, backends
        _ext.load_cpp()
        print(backends.describe()["cpp_variant"])
        """,
        {"LORAFUSE_CPU_CAPABILITY": "default"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("default (")


def test_prebuilt_modules_are_used_only_for_their_torch_minor(tmp_path, monkeypatch):
    monkeypatch.setattr(_ext, "PREBUILT", tmp_path)
    assert _ext.prebuilt("avx2") == (None, "no prebuilt kernels (source install)")
    (tmp_path / "TORCH_VERSION").write_text("2.9.1+cpu\n")
    path, why = _ext.prebuilt("avx2")
    assert path is None and why.startswith("the prebuilt kernels are for torch 2.9.1+cpu")
    (tmp_path / "TORCH_VERSION").write_text(torch.__version__)
    assert _ext.prebuilt("avx2")[0] is None  # stamp matches, module missing
    so = tmp_path / f"lorafuse_cpp_avx2{sysconfig.get_config_var('EXT_SUFFIX')}"
    so.write_bytes(b"")
    assert _ext.prebuilt("avx2") == (so, "prebuilt")
    assert _ext.torch_minor("2.13.0+cpu") == "2.13"


PREBUILT_LOAD = """
    from pathlib import Path
    from lorafuse import _ext, backends
    _ext.PREBUILT = Path({directory!r})
    if {no_build}:
        _ext.build = None  # a build would fail: the prebuilt module must be imported
    _ext.load_cpp()
    print(backends.cpp_variant())
    """


def _load_with_prebuilt(directory: Path, no_build: bool = False):
    return _python(PREBUILT_LOAD.format(directory=str(directory), no_build=no_build))


def test_a_matching_prebuilt_module_is_imported_without_building(tmp_path):
    _ext.load_cpp()  # the cache's build of this variant stands in for a wheel's module
    variant = _ext.chosen()
    name = _ext.module_name(variant)
    shutil.copy(
        _ext.build_dir() / f"{name}.so",
        tmp_path / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}",
    )
    (tmp_path / "TORCH_VERSION").write_text(torch.__version__ + "\n")
    out = _load_with_prebuilt(tmp_path, no_build=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{variant} (prebuilt)"
    assert "lorafuse:" not in out.stderr  # no compile message, no fallback line


@pytest.mark.parametrize("case", ["other torch", "does not load"])
def test_an_unusable_prebuilt_module_says_why_and_builds(tmp_path, case):
    _ext.load_cpp()  # built in the cache, so the fallback only loads it
    variant = _ext.chosen()
    so = tmp_path / f"{_ext.module_name(variant)}{sysconfig.get_config_var('EXT_SUFFIX')}"
    so.write_bytes(b"not an ELF file")
    stamp = "2.9.1+cpu" if case == "other torch" else torch.__version__
    (tmp_path / "TORCH_VERSION").write_text(stamp + "\n")
    out = _load_with_prebuilt(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(f"{variant} (cache ")
    why = [line for line in out.stderr.splitlines() if "building the C++ kernels instead" in line]
    assert len(why) == 1, out.stderr
    if case == "other torch":
        assert (
            f"the prebuilt kernels are for torch 2.9.1+cpu, this is torch {torch.__version__}"
            in why[0]
        )
    else:
        assert f"the prebuilt {variant} kernels do not load" in why[0] and str(so) in why[0]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_module_needs_no_glibc_newer_than_2_28():
    """csrc/glibc_compat.h keeps the module on glibc 2.28 symbols (manylinux_2_28, torch's own
    floor) whatever glibc builds it: every versioned symbol it imports is GLIBC_2.28 or older."""
    _ext.load_cpp()
    so = _ext.build_dir() / f"{_ext.module_name(_ext.chosen())}.so"
    table = subprocess.run(["objdump", "-T", str(so)], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    versions = {tuple(int(p) for p in v.split(".")) for v in re.findall(r"\bGLIBC_([\d.]+)", table)}
    assert versions, "no GLIBC versions found: the scan is blind"
    assert max(versions) <= (2, 28), sorted(versions)
    assert "__libc_single_threaded" not in table
