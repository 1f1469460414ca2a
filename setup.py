"""Packaging: a pure source package by default; a platform wheel with prebuilt C++ kernels on demand.

* ``pip install -e .`` / ``pip install .``: pure Python, nothing compiles; the C++ kernels build on
  first use (``lorafuse._ext``, JIT, cached).
* ``LORAFUSE_BUILD_WHEEL_KERNELS=1 pip wheel . --no-build-isolation --no-deps``: compiles every
  CPU variant of this platform (x86-64: default, avx2, avx512; aarch64: default) with the JIT
  build's own code and flags (``_ext.build``, so the binaries are the ones a source install
  builds) into ``lorafuse/_prebuilt/`` with a ``TORCH_VERSION`` stamp, pins torch to the minor it
  was built against and tags the wheel for this Python and platform. A comma list
  (``=default,avx2``) builds only those variants.

Why an environment variable and not "compile in every bdist_wheel": the build needs the torch it
will run with, which only a build without isolation has (torch is not a build requirement: an
isolated build would fetch another torch and bind the wrong ABI), and pip asks for the metadata
(the torch pin) in a separate step from the wheel; a rule on the environment gives the same answer
in both steps, and a plain ``pip install .`` stays pure and fast.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

KERNELS_ENV = "LORAFUSE_BUILD_WHEEL_KERNELS"
DEPENDENCIES = [
    "torch>=2.4",
    "transformers>=5.0,<6",  # patching follows transformers 5 modeling code (tested: 5.24)
    "peft>=0.17,<1",  # tested: 0.21
    "safetensors>=0.4",
    "gguf>=0.10",
    "tqdm",
    "pyyaml",
    "numpy",
    "psutil",
    "ninja",  # builds the C++ CPU kernels on first use (the default CPU path; a wheel's fallback)
]


def _wanted() -> list[str] | None:
    """The variants to prebuild (None: a pure package)."""
    value = os.environ.get(KERNELS_ENV, "").strip().lower()
    if value in ("", "0", "no", "false"):
        return None
    if "editable_wheel" in sys.argv:
        raise SystemExit(f"{KERNELS_ENV} builds a wheel (pip wheel .), not an editable install")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit(
            f"{KERNELS_ENV}: torch is not importable in the build environment; build with "
            "`pip wheel . --no-build-isolation` against the torch the wheel is for"
        ) from None
    sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))
    from lorafuse import hardware

    platform_variants = ["default"] if hardware.is_arm() else list(hardware.VARIANTS)
    if value in ("1", "yes", "true", "all"):
        return platform_variants
    asked = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in asked if v not in platform_variants]
    if unknown:
        raise SystemExit(
            f"{KERNELS_ENV}={value}: {', '.join(unknown)} not among this platform's variants "
            f"({', '.join(platform_variants)})"
        )
    return asked


def _torch_pin() -> str:
    """``torch>=2.13,<2.14``: a module built against one torch minor binds its C++ ABI."""
    import torch

    from lorafuse import _ext

    major, minor = (int(p) for p in _ext.torch_minor(torch.__version__).split("."))
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


class BuildWithKernels(build_py):
    """build_py, then the prebuilt variants and their torch stamp into ``lorafuse/_prebuilt``."""

    def run(self) -> None:
        super().run()
        variants = _wanted()
        if variants:
            _prebuild(variants, Path(self.build_lib) / "lorafuse" / "_prebuilt")


def _prebuild(variants: list[str], out: Path) -> None:
    import torch

    from lorafuse import _ext, hardware

    runs = hardware.cpu_variants()
    if any(v not in runs for v in variants):  # each build is imported once, as the JIT does
        raise SystemExit(
            f"{KERNELS_ENV}: this CPU runs only {', '.join(runs)}; build the {', '.join(variants)}"
            f" wheel on a CPU that runs all of them, or name fewer ({KERNELS_ENV}=default,avx2)"
        )
    # Objects stay in build/ between wheel builds (keyed like the JIT cache: sources, flags, torch).
    os.environ[_ext.CACHE_ENV] = str(Path("build") / "lorafuse-kernels")
    out.mkdir(parents=True, exist_ok=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for variant in variants:
        print(f"lorafuse: building the {variant} C++ kernels ({' '.join(_ext.compile_flags(variant))})",
              flush=True)  # fmt: skip
        _, directory, _ = _ext.build(variant)
        name = _ext.module_name(variant)
        shutil.copy2(directory / f"{name}.so", out / f"{name}{suffix}")
    (out / "TORCH_VERSION").write_text(torch.__version__ + "\n")


class PlatformDistribution(Distribution):
    """Tags the wheel for this Python and platform when it carries compiled modules."""

    def has_ext_modules(self) -> bool:
        return _wanted() is not None


_variants = _wanted()
setup(
    distclass=PlatformDistribution,
    cmdclass={"build_py": BuildWithKernels},
    install_requires=[
        _torch_pin() if _variants and d.startswith("torch") else d for d in DEPENDENCIES
    ],
)
