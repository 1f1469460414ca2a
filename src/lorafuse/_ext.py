"""Builds and loads the C++ CPU extension (``csrc/*.cpp``) on first use, cached on disk.

A wheel's prebuilt variant (``lorafuse/_prebuilt``, stamped with its torch version) loads
directly; otherwise all of ``csrc/*.cpp`` compile into one module in
``$LORAFUSE_CACHE/ext/<torch version>-<key>`` (``key`` hashes sources, headers, flags, ABI and
torch), marked ``BUILD_OK`` when done, locked against a second builder. Problems raise
:class:`ExtensionUnavailable` with a one-line reason. The cache and build rules: docs/install.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import io
import os
import shlex
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from lorafuse import files, hardware

CSRC = Path(__file__).resolve().parent / "csrc"
PREBUILT = Path(__file__).resolve().parent / "_prebuilt"  # a wheel's modules (setup.py)
CACHE_ENV = "LORAFUSE_CACHE"
_MARKER = "BUILD_OK"

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None
_origin: str | None = None


class ExtensionUnavailable(RuntimeError):
    """The C++ extension cannot be built or loaded here (no compiler, no ninja, build error)."""


def cache_root() -> Path:
    """``$LORAFUSE_CACHE`` or ``~/.cache/lorafuse``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lorafuse").expanduser()


# Per-capability variants: the same sources compiled as complete modules, one per ISA level
# (``lorafuse_cpp_<variant>``), so a wheel can carry several and the loader imports the one this
# CPU runs (:func:`lorafuse.backends.cpu_variant` chooses). The ``-m`` flags are ATen's own for its
# ``Vectorized`` specialisations (AVX2: 8 floats per op, AVX-512: 16); ``default`` is the x86-64
# baseline (and aarch64, where ATen's default vectors are NEON). Whole-TU flags are safe only
# because a variant is loaded where it runs; AVX-512-BF16 and AMX stay behind run-time checks.
VARIANT_FLAGS: dict[str, list[str]] = {
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}  # fmt: skip
VARIANTS = hardware.VARIANTS
assert tuple(VARIANT_FLAGS) == VARIANTS
# Binaries that load on glibc 2.28 (manylinux_2_28, as torch's wheels) whatever glibc builds them:
# csrc/glibc_compat.h says how.
GLIBC_FLOOR = [
    "-D__libc_single_threaded=lorafuse_libc_single_threaded",
    "-include",
    "glibc_compat.h",
]


def chosen(variant: str | None = None) -> str:
    """``variant``, or (None) the one :func:`lorafuse.hardware.cpu_variant` chooses here."""
    if variant is None:
        return hardware.cpu_variant()
    return variant


def compile_flags(variant: str | None = None) -> list[str]:
    """C++ flags of ``variant`` (:data:`VARIANT_FLAGS`; default the chosen one), never
    ``-march=native``: the flags are part of the cache key, so each variant gets its own build
    directory."""
    variant = chosen(variant)
    if variant not in VARIANT_FLAGS:
        raise ValueError(f"unknown CPU variant {variant!r}: one of {', '.join(VARIANTS)}")
    return [
        "-O3",
        "-fopenmp",
        "-DNDEBUG",
        *GLIBC_FLOOR,
        *VARIANT_FLAGS[variant],
    ]  # -fopenmp: at::parallel_for


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def build_key(variant: str | None = None) -> str:
    """Hash of everything that changes the binary: sources, headers, flags, torch, Python ABI."""
    h = hashlib.sha256()
    for part in (torch.__version__, sys.implementation.cache_tag, sysconfig.get_platform()):
        h.update(part.encode() + b"\0")
    h.update(" ".join(compile_flags(variant)).encode() + b"\0")
    for path in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_dir(variant: str | None = None) -> Path:
    variant = chosen(variant)
    return cache_root() / "ext" / f"{torch.__version__}-{variant}-{build_key(variant)}"


def module_name(variant: str) -> str:
    # One name per variant (so several can be loaded or shipped side by side), constant across
    # versions, so a new build directory seeded from the previous one of the same variant
    # recompiles only the changed files.
    if variant not in VARIANT_FLAGS:
        raise ValueError(f"unknown CPU variant {variant!r}: one of {', '.join(VARIANTS)}")
    return f"lorafuse_cpp_{variant}"


def _seed_from_previous(directory: Path) -> None:
    """Copy the newest finished sibling build (objects, ninja logs, mtimes) into a new build dir,
    so ninja recompiles only the sources that changed since then (a full build is minutes)."""
    prefix = directory.name.rsplit("-", 1)[0] + "-"  # same torch and variant
    done = [
        p for p in directory.parent.glob(prefix + "*") if p != directory and (p / _MARKER).exists()
    ]
    if not done:
        return
    previous = max(done, key=lambda p: (p / _MARKER).stat().st_mtime)
    try:
        for item in previous.iterdir():
            if item.is_file() and item.name not in (_MARKER, "build.log"):
                shutil.copy2(item, directory / item.name)
    except OSError:  # the sibling vanished mid-copy (a concurrent --force): build from scratch
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another process builds this directory
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _check_toolchain() -> None:
    cxx = os.environ.get("CXX") or "c++"
    exe = shlex.split(cxx)[0] if cxx.strip() else "c++"
    if shutil.which(exe) is None:
        raise ExtensionUnavailable(f"C++ compiler {exe!r} not found (set $CXX or install g++)")
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise ExtensionUnavailable("ninja not found (pip install ninja)")


def _import_built(name: str, directory: Path, path: Path | None = None) -> ModuleType:
    path = path or directory / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExtensionUnavailable(f"cannot import {path}")
    try:
        module = importlib.util.module_from_spec(spec)  # an extension is dlopen()ed here
        spec.loader.exec_module(module)
    except ImportError as err:
        raise ExtensionUnavailable(f"cannot import {path}: {err}") from err
    return module


def _first_error_line(text: str) -> str:
    """The compiler's first ``file:line: error: ...`` line (else the first line of the text)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for needle in (": error:", "fatal error", "error:"):
        for line in lines:
            if needle in line:
                return line[:300]
    return (lines or ["unknown error"])[0][:300]


def _compile(variant: str, directory: Path, verbose: bool) -> ModuleType:
    from torch.utils.cpp_extension import load

    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log if not verbose else sys.stdout):
            module = load(
                name=module_name(variant),
                sources=[str(p) for p in sources()],
                extra_cflags=compile_flags(variant),
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(CSRC)],
                build_directory=str(directory),
                verbose=verbose,
            )
    except Exception as err:  # cpp_extension raises RuntimeError/CalledProcessError/OSError
        text = f"{log.getvalue()}\n{err}"
        (directory / "build.log").write_text(text)
        raise ExtensionUnavailable(
            f"build failed: {_first_error_line(str(err))} (full log: {directory / 'build.log'})"
        ) from err
    return module


def _is_built(directory: Path, name: str) -> bool:
    return (directory / _MARKER).exists() and (directory / f"{name}.so").exists()


def is_built(variant: str | None = None) -> bool:
    """Whether this version of the sources is already built in the cache (no build starts)."""
    variant = chosen(variant)
    return _is_built(build_dir(variant), module_name(variant))


def build(
    variant: str | None = None, force: bool = False, verbose: bool = False
) -> tuple[ModuleType, Path, bool]:
    """Build (or reuse) ``variant`` (default the chosen one).
    Returns ``(module, build dir, compiled_now)``."""
    variant = chosen(variant)
    directory, name = build_dir(variant), module_name(variant)
    if not force and _is_built(directory, name):  # no lock: a finished build is never modified
        return _import_built(name, directory), directory, False
    try:
        with _file_lock(directory.parent / f"{directory.name}.lock"):
            if force and directory.exists():
                shutil.rmtree(directory)
            if _is_built(directory, name):  # another process built it while we waited
                return _import_built(name, directory), directory, False
            _check_toolchain()
            if not directory.exists():
                directory.mkdir(parents=True)
                if not force:
                    _seed_from_previous(directory)
            # cpp_extension's own lock file, left by a killed build, would make load() wait
            # forever; under our lock no other builder of this directory is alive
            (directory / "lock").unlink(missing_ok=True)
            start = time.perf_counter()
            module = _compile(variant, directory, verbose)
            # atomic: readers see a whole build or none
            files.write_text(directory / _MARKER, f"built in {time.perf_counter() - start:.1f} s\n")
            return module, directory, True
    except OSError as err:  # unwritable cache, full disk
        raise ExtensionUnavailable(f"cannot write the build cache {directory}: {err}") from err


def torch_minor(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13``: the ABI a prebuilt module was built against."""
    return ".".join(version.split("+")[0].split(".")[:2])


def prebuilt(variant: str) -> tuple[Path | None, str]:
    """The wheel's prebuilt ``variant`` module (``lorafuse/_prebuilt``, written by ``setup.py``)
    if it matches the running torch minor, else ``(None, why not)``."""
    stamp = PREBUILT / "TORCH_VERSION"
    path = PREBUILT / f"{module_name(variant)}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if not stamp.exists():
        return None, "no prebuilt kernels (source install)"
    built_for = stamp.read_text().strip()
    if torch_minor(built_for) != torch_minor(torch.__version__):
        return None, (f"the prebuilt kernels are for torch {built_for}, this is torch "
                      f"{torch.__version__}")  # fmt: skip
    if not path.exists():
        return None, f"no prebuilt {variant} variant in {PREBUILT}"
    return path, "prebuilt"


def _import_prebuilt(variant: str, path: Path) -> ModuleType:
    return _import_built(module_name(variant), path.parent, path)


def _configure(module: ModuleType) -> None:
    cpu = torch.device("cpu")
    module.set_native_low_precision(
        bf16=hardware.native_low_precision_matmul(cpu, torch.bfloat16),
        fp16=hardware.native_low_precision_matmul(cpu, torch.float16),
    )


def reconfigure() -> None:
    """Re-apply :mod:`lorafuse.hardware`'s answer (e.g. a changed ``$LORAFUSE_CPU_LOW_PRECISION``)
    to the loaded extension; nothing is built or loaded if it is not loaded yet (the first load
    configures itself). The tests use this to run both CPU branches in one process."""
    hardware.low_precision_override()  # a bad value raises here, before anything changes
    with _lock:
        if _module is not None:
            _configure(_module)


def is_loaded() -> bool:
    """Whether the extension is loaded in this process (nothing is built or imported to answer)."""
    return _module is not None


def loaded_from() -> str | None:
    """``"<variant> (prebuilt|cache <dir>)"`` for the loaded module, else None."""
    return _origin


def load_cpp(force: bool = False) -> ModuleType:
    """The extension module of the variant :func:`lorafuse.backends.cpu_variant` chooses: the
    wheel's prebuilt one when it matches this torch, else built on first use; raises
    :class:`ExtensionUnavailable` (and ``backends.CpuVariantError`` for a bad forced variant).

    A failure is remembered for the process (a rebuild takes a minute); ``force=True`` retries
    and rebuilds from scratch.
    """
    global _module, _failure, _origin
    module = _module
    if module is not None and not force:  # loaded: no lock (ops ask on every call)
        return module
    with _lock:
        if _module is not None and not force:
            return _module
        if _failure is not None and not force:
            raise ExtensionUnavailable(_failure)
        variant = chosen()
        path, why = prebuilt(variant)
        if path is not None and not force:
            try:
                module = _import_prebuilt(variant, path)
            except ExtensionUnavailable as err:  # e.g. a torch build of another ABI
                why = f"the prebuilt {variant} kernels do not load ({err})"
            else:
                _configure(module)
                _module, _failure, _origin = module, None, f"{variant} (prebuilt)"
                return module
        if PREBUILT.joinpath("TORCH_VERSION").exists():  # a wheel that cannot be used: say why
            print(f"lorafuse: {why}; building the C++ kernels instead", file=sys.stderr,
                  flush=True)  # fmt: skip
        if force or not is_built(variant):  # a first use builds: minutes, so say so
            print(f"lorafuse: compiling the C++ CPU kernels ({variant} variant; once per install "
                  "and CPU, minutes on a small machine; `lorafuse build-ext` does it ahead of "
                  "time)", file=sys.stderr, flush=True)  # fmt: skip
        try:
            module, directory, compiled = build(variant, force=force)
        except ExtensionUnavailable as err:
            _failure = str(err)
            raise
        if compiled:
            print(f"lorafuse: C++ CPU kernels built ({directory})", file=sys.stderr, flush=True)
        _configure(module)
        _module, _failure, _origin = module, None, f"{variant} (cache {directory})"
        return module
