"""The one place that decides which kernel implementation runs: ``torch`` | ``cpp`` | ``triton``.

Nothing else in lorafuse branches on device or backend. Every op asks :func:`select` with its
name and the device of its input; the answer depends on

* the request: the ``backend=`` argument of the op, else the env var ``LORAFUSE_KERNELS``
  (``auto`` | ``torch`` | ``cpp`` | ``triton``), default ``auto``;
* what exists for the op (:data:`KERNELS`) and builds here (compiler, Triton);
* on ``auto``, what was *measured* faster than the torch reference (:data:`CPP_DEFAULT`,
  :data:`TRITON_DEFAULT`). A fast path that is not measured faster is not the default.

A requested backend that cannot run is never swapped silently: ``cpp`` without a compiler warns
once, loudly, and runs torch; ``triton`` without CUDA (and without ``TRITON_INTERPRET=1``)
raises, because that request cannot mean anything else. A call the compiled kernels cannot take
(``unsupported=`` says why, e.g. RMSNorm's mixed dtypes) runs torch with one warning.

Every choice is recorded (:func:`choices`, shown by :func:`describe`), including the ones made
between implementations that are not lorafuse backends (the NF4 dequantiser: :func:`record`), so
a report says what ran where and why.

**Two levels.** This module chooses the backend family per op and device, and the C++ build
(:func:`cpu_variant`). Each op chooses among its own variants and shape rules in the policy
block of its file (marked ``# ---- Policy``), and the C++ kernels choose their inner products by
CPU at run time. Nothing else chooses. Every choice, with where its rule and its measured reason
live:

====================  ============================================  ================================
choice                rule                                          where, and why
====================  ============================================  ================================
backend per op        request, else measured-faster default         here: :data:`CPP_DEFAULT`
C++ build             widest of default/avx2/avx512 the CPU runs    :func:`cpu_variant` (CPUID)
matmul dtype          fp32 where bf16/fp16 GEMMs are emulated       ``hardware.matmul_dtype``
lora_linear, conv2d   the plain call: one C++ autograd Function     ``ops/lora_linear._fast``,
                      (``csrc/lora_autograd.cpp``)                  ``ops/lora_conv._fast``
rms_norm dtypes       mixed x / weight dtypes run torch             ``ops/rms_norm.rms_norm``
attention length      C++ to ``AUTO_MAX_LENGTH`` tokens, by dtype   ``ops/attention.py``
attention products    oneDNN brgemm (bf16, head dim % 16), MKL's    ``ops/attention.kernel_dtype``,
                      bf16 GEMM, else fp32 sgemm                    ``csrc/attention_products.h``
Q/K/V, gate/up stack  stacked A products where measured faster      ``ops/lora_projection.stackable``
quantized tiles       dense copies of ``TILE_BYTES`` at most        ``ops/weights.tiled``
rank-r products       C++ for fp32 adapters on the cpp backend      ``ops/lora_rank.rank_ops``
rank-r kernels        bf16x3 GEMMs (AMX), FMA kernels, fp32 tiles   ``csrc/lora_rank*.cpp``
                                                                    (``use_bf16x3``, ``use_fma``)
loss chunk            rows whose fp32 logits fit ``CHUNK_BYTES``    ``ops/cross_entropy.chunk_rows``
DoRA weight norm      rows with κ > ``KAPPA_MAX`` recomputed dense  ``ops/dora.py``
decode rows           C++ up to ``NATIVE_MAX_ROWS`` / ``MAX_ROWS``  ``ops/decode_linear.py``
NF4 dequantiser       bitsandbytes (CUDA), C++ (CPU), torch         ``ops/nf4.dequantizer``
NF4 decode            C++ from the codes up to ``DECODE_MAX_ROWS``  ``ops/nf4.decodes``
NF4 decode body       in registers on AVX-512, else row tiles       ``csrc/decode_linear.cpp``
CPU heap policy       large buffers + glibc thresholds, on request  ``heap.apply_training_policy``
====================  ============================================  ================================
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from lorafuse import _ext, hardware
from lorafuse.errors import LorafuseError, SettingError
from lorafuse.hardware import (  # noqa: F401 (re-exported)
    CPU_VARIANT_ENV,
    CpuVariantError,
    cpu_variant,
    cpu_variants,
    matmul_dtype,
    native_low_precision_matmul,
)

ENV_VAR = "LORAFUSE_KERNELS"
CHOICES = ("auto", "torch", "cpp", "triton")

# Ops that have an implementation besides the torch reference, per backend.
KERNELS: dict[str, set[str]] = {
    "cpp": {
        "lora_linear",
        "dora_linear",  # ops/dora.py: lora_linear's C++ kernels plus torch steps
        "rms_norm",
        "rope",
        "swiglu",
        "cross_entropy",
        "attention",
        "lora_conv2d",
        "nf4_dequantize",  # ops/nf4.py: dequantize, dequantize_columns, decode_linear
        "decode_linear",  # ops/decode_linear.py: dense bf16/fp16 layers given a few rows
        "decode_engine",  # decode/engine.py + ops/quant_linear.py: the C++ decoder step
        "gated_delta",  # ops/gated_delta.py: Gated DeltaNet's chunked rule and its backward
        "causal_conv1d",  # ops/causal_conv1d.py: the hybrids' short depthwise convolutions
        "mamba2_scan",  # ops/mamba2_scan.py: chunked scan forward/backward, one decoding step
        "int8_linear",  # ops/int8_linear.py: int8 frozen products (load_in_int8)
        "moe_lora",  # ops/moe_lora.py: routed experts grouped by expert, loop in C++
    },
    "triton": {
        "lora_linear",
        "dora_linear",
        "rms_norm",
        "rope",
        "swiglu",
        "cross_entropy",
        "lora_conv2d",
        "gated_delta",  # forward and decoding only (ops/gated_delta.py runs torch for gradients)
        "causal_conv1d",
        "moe_lora",  # triton/moe_lora.py: grouped GEMMs over (expert, row-tile) programs
    },
}
# Ops whose fast path was measured faster than torch (benchmarks/ops/<op>.py); `auto` uses these.
# torch / C++ time, fwd+bwd, medians of interleaved runs (`python benchmarks/ops/cpu_all.py`,
# 2 threads, AVX2 EPYC): lora_linear fp32 N=2048 d=k=2048 r=16 1.10x, bf16 N=128 18.7x; rms_norm
# 6.5x (fp32) / 9.1x (bf16); swiglu 6.0x / 10.6x; rope 11.6x; cross_entropy chunk 3.7x; attention
# (B=4 T=512 D=64 fp32, against torch's flash kernel) 1.8-2.0x. lora_conv2d:
# `benchmarks/ops/lora_conv.py` (SD1.5 convs, batch 1, fp32): C++ / torch time 0.67-1.00.
# nf4_dequantize: `benchmarks/ops/nf4.py --threads 1`, bf16, 4.3-14x, bit-identical output.
# decode_linear: `benchmarks/ops/decode_linear.py --threads 1`, one row, bf16 1.44-2.06x
# (SmolLM2-135M and Llama-3.2-1B shapes). dora_linear: `benchmarks/ops/dora.py --threads 1`
# (SmolLM2-135M q/gate/down, 512 tokens, r 16, fp32, loaded 2-core EPYC): 1.06-1.15x.
# gated_delta: `python benchmarks/ops/gated_delta.py --threads 1 --clock cpu` (Qwen3.5-0.8B-like,
# Hv 16, Dk = Dv = 128, 1-4 x 512-2048 tokens, AMX Xeon), transformers' torch function / C++:
# forward 2.7-3.4x, forward + backward 2.9-6.1x, decoding step 2.8-3.5x (fp32 and bf16).
# Rechecked (`--threads 1 --clock cpu --repeats 3 --shapes 1,512,16`, load 31): C++ fwd 3.0x (fp32)
# / 3.2x (bf16), fwd+bwd 3.3x / 3.1x, decoding 2.5-3.2x; our torch backend 0.8-1.3x of transformers'.
# causal_conv1d: `python benchmarks/ops/causal_conv1d.py --threads 1 --clock cpu` (6144 channels,
# K 4, SiLU, same CPU): causal_conv1d_fn / C++ forward 2.6-4.6x, forward + backward 2.5-3.8x.
# Rechecked (`--threads 1 --clock cpu --repeats 3 --shapes 1,512,6144`, load 15-23): C++ fwd 4.6x
# (fp32) / 2.6x (bf16), fwd+bwd 3.4x / 3.0x, decoding 1.2-1.9x; our torch backend's fwd+bwd is
# 0.52-0.72x of transformers' (its gradient convolutions; what CUDA runs while TRITON_DEFAULT is
# empty).
# mamba2_scan: `benchmarks/ops/mamba2_scan.py --tokens 512 --repeats 3 --threads 1 --subs`
# (Granite-4.0-H-Tiny widths: 48 heads of 64, state 128; AMX Xeon under load 31), transformers'
# torch scan / C++: fp32 fwd 11.3x, fwd+bwd 10.2x, bf16 14.4x / 13.9x, decoding step (4 rows) 154x;
# our torch backend 0.89-0.98x of transformers'.
# moe_lora: `benchmarks/ops/moe_lora.py --tokens 128 --experts 16 --repeats 5` (Qwen3-30B-A3B's
# expert geometry, r 16, fwd+bwd, 2 threads, AMX Xeon at load ~27): torch / C++ 2.42x bf16,
# 1.65x fp32.
CPP_DEFAULT: set[str] = {
    "lora_linear", "rms_norm", "rope", "swiglu", "cross_entropy", "attention", "nf4_dequantize",
    "lora_conv2d", "decode_linear", "dora_linear", "gated_delta", "causal_conv1d", "mamba2_scan",
    # int8_linear: its torch reference multiplies in float64 (the exact oracle, ~40 GFLOP/s on
    # one AMX core at 2048 x 576 x 576); the kernel runs the SmolLM2 projections' forward + input
    # gradient at 270-920 there (benchmarks/ops/int8_linear.py --threads 1 --clock cpu)
    "int8_linear", "moe_lora", "decode_engine",
}  # fmt: skip
# Empty until a GPU measurement shows an op faster than torch: `bash scripts/gpu_check.sh` runs
# benchmarks/ops/gpu_all.py, which prints torch vs triton per op and, for each op measured faster,
# the exact line to put here (with its number in a comment, as CPP_DEFAULT has).
TRITON_DEFAULT: set[str] = set()
# C++ kernels that need more than the extension itself, checked once by a self-test exported as
# `<op>_<name>`: attention, gated_delta and mamba2_scan call the BLAS sgemm (dgemm) of torch's
# own libraries (found at run time). int8_linear runs oneDNN's int8 micro-kernel, which
# exists only on AMX / AVX-512-VNNI CPUs.
CPP_SELF_TEST: dict[str, str] = {
    "attention": "available", "gated_delta": "available", "mamba2_scan": "available",
    "int8_linear": "available",
}  # fmt: skip
_NO_BLAS = "no BLAS sgemm_/dgemm_ found in this torch build"
_SELF_TEST_MISSING = {"int8_linear": "no oneDNN int8 micro-kernel on this CPU"}
# Triton modules named other than their op (`lorafuse.triton.<module>`); the rest use the op name.
TRITON_MODULES: dict[str, str] = {"lora_conv2d": "lora_conv", "dora_linear": "dora"}

# The last choice per (op, device type): (implementation, why). Written by select() and record().
_choices: dict[tuple[str, str], tuple[str, str]] = {}
_warned: set[tuple[str, str]] = set()


class BackendError(LorafuseError, RuntimeError):
    """A backend was requested that cannot run the op on this device (``LORAFUSE_KERNELS=triton``
    on a CPU): the user can fix it, so it ends as one line like every :class:`LorafuseError`."""


def requested(override: str | None = None) -> str:
    """The backend asked for: ``override`` if given, else ``$LORAFUSE_KERNELS``, else ``auto``."""
    choice = (override or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if choice not in CHOICES:
        source = "backend argument" if override else ENV_VAR
        raise SettingError(f"{source}={choice!r} is not one of {', '.join(CHOICES)}")
    return choice


@functools.cache
def cpp_available() -> bool:
    """True when the C++ CPU extension is built (or builds now); warns once when it cannot."""
    try:
        _ext.load_cpp()
        return True
    except _ext.ExtensionUnavailable as err:
        warnings.warn(
            f"lorafuse: C++ CPU kernels unavailable ({err}); running the plain-PyTorch "
            "kernels instead. Install a C++ compiler and ninja, then `lorafuse build-ext`.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False


@functools.cache
def cpp_ready(op: str) -> bool:
    """The extension is available and ``op``'s self-test (:data:`CPP_SELF_TEST`) passes; warns once."""
    if not cpp_available():
        return False
    test = CPP_SELF_TEST.get(op)
    if test is None or compiled(op, "cpp", test)[0]():
        return True
    warnings.warn(
        f"lorafuse: the C++ {op} kernel failed its self-test ({op}_{test}: "
        f"{_SELF_TEST_MISSING.get(op, _NO_BLAS)}); running the plain-PyTorch kernel instead",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


def triton_runs_on(device: torch.device) -> bool:
    """Triton runs on CUDA, and on CPU tensors only under ``TRITON_INTERPRET=1`` (tests)."""
    if not triton_importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreting())


def record(op: str, device: torch.device | str, choice: str, why: str) -> str:
    """Note a kernel choice (made here, or by a module choosing among implementations that are
    not lorafuse backends, e.g. bitsandbytes' NF4 dequantiser) for :func:`choices`."""
    _choices[(op, torch.device(device).type)] = (choice, why)
    return choice


def choices() -> dict[str, str]:
    """Every op's latest choice in this process: ``"op (device)" -> "impl: why"``."""
    return {f"{op} ({dev})": f"{c}: {why}" for (op, dev), (c, why) in sorted(_choices.items())}


def _warn_once(op: str, message: str) -> None:
    if (op, message) not in _warned:
        _warned.add((op, message))
        warnings.warn(f"lorafuse {op}: {message}", RuntimeWarning, stacklevel=4)


def select(
    op: str,
    device: torch.device | str,
    override: str | None = None,
    *,
    unsupported: str | None = None,
) -> str:
    """Pick the backend that runs ``op`` on ``device`` (and record it with the reason).

    ``unsupported``: why the compiled kernels cannot take this particular call (its dtypes, say);
    then torch runs, with one warning when a compiled backend was asked for or would be chosen.
    """
    device = torch.device(device)
    choice, why = _select(op, device, requested(override))
    if unsupported and choice != "torch":
        _warn_once(op, f"{unsupported}; the {choice} kernel cannot take it, running torch")
        choice, why = "torch", unsupported
    return record(op, device, choice, why)


# select()'s answers on CPU per (op, override, $LORAFUSE_KERNELS), for ops that ask on every call
# (the image LoRA ops' per-call fast path: a few µs of the ~50 µs a call may add). On CPU the
# answer depends on nothing else but cpp_ready(), itself cached. "triton" answers (CPU tensors
# under TRITON_INTERPRET, tests only) and errors are not cached; a hit is recorded again, so
# choices() keeps the latest choice.
_cpu_selected: dict[tuple[str, str | None, str | None], tuple[str, str]] = {}


def select_cpu(op: str, override: str | None = None) -> str:
    """:func:`select` for a CPU tensor, cached (see :data:`_cpu_selected`)."""
    key = (op, override, os.environ.get(ENV_VAR))
    hit = _cpu_selected.get(key)
    if hit is not None:
        _choices[(op, "cpu")] = hit
        return hit[0]
    choice = select(op, "cpu", override)
    if choice != "triton":
        _cpu_selected[key] = _choices[(op, "cpu")]
    return choice


def _select(op: str, device: torch.device, choice: str) -> tuple[str, str]:
    if choice == "torch":
        return "torch", "requested"
    if choice == "triton":
        if op not in KERNELS["triton"]:
            raise BackendError(f"no Triton kernel for {op}; use backend='torch' or 'auto'")
        if not triton_runs_on(device):
            raise BackendError(
                f"Triton kernels need a CUDA tensor (got {device.type}) and the triton package "
                "(CPU tensors run only with TRITON_INTERPRET=1, for tests)"
            )
        return "triton", "requested"
    if choice == "cpp":
        if op not in KERNELS["cpp"]:
            raise BackendError(f"no C++ kernel for {op}; use backend='torch' or 'auto'")
        if device.type != "cpu":
            raise BackendError(f"C++ kernels run on CPU tensors, got {device.type}")
        return ("cpp", "requested") if cpp_ready(op) else ("torch", "C++ kernel unavailable")
    # auto
    if device.type == "cuda" and op in TRITON_DEFAULT and triton_runs_on(device):
        return "triton", "auto: measured faster on GPU"
    if device.type == "cpu" and op in CPP_DEFAULT:
        if cpp_ready(op):
            return "cpp", "auto: measured faster on CPU"
        return "torch", "auto: C++ kernel unavailable"
    if device.type == "cuda" and op in KERNELS["triton"]:
        return "torch", "auto: Triton not measured faster on GPU yet"
    return "torch", "auto: no faster kernel for this device"


def compiled(op: str, backend: str, *names: str) -> tuple:
    """The ``cpp`` or ``triton`` implementation functions ``names`` of ``op``.

    C++ kernels are exported from the extension as ``<op>_<name>``; Triton kernels live in
    ``lorafuse.triton.<op>`` (or :data:`TRITON_MODULES`) as ``<name>``. Ops keep their torch
    reference themselves.
    """
    if backend == "cpp":
        return _extension_functions(_ext.load_cpp(), op, names)
    if backend == "triton":
        module = importlib.import_module(f"lorafuse.triton.{TRITON_MODULES.get(op, op)}")
        return tuple(getattr(module, name) for name in names)
    raise BackendError(f"no compiled implementation for backend {backend!r}")


@functools.cache
def _extension_functions(ext, op: str, names: tuple[str, ...]) -> tuple:
    """``ext``'s ``<op>_<name>`` functions, looked up once per loaded module: ops ask on every
    call, and on a decoding step's small layers the lookup cost as much as the product."""
    return tuple(getattr(ext, f"{op}_{name}") for name in names)


def cpp_variant() -> str | None:
    """The loaded C++ variant and where it came from (``"avx512 (prebuilt)"``), None if not
    loaded (nothing is loaded to answer)."""
    return _ext.loaded_from()


def describe() -> dict[str, object]:
    """What runs where on this machine (for `lorafuse bench`, reports and bug reports)."""
    cpu = torch.device("cpu")
    return {
        "requested": requested(),
        "cpp": cpp_available(),
        "cpp_variant": cpp_variant(),
        "triton_importable": triton_importable(),
        "cuda": torch.cuda.is_available(),
        "cpu_capability": hardware.cpu_capability(),
        "cpu_bf16_native": native_low_precision_matmul(cpu, torch.bfloat16),
        "cpu_low_precision_override": hardware.low_precision_override(),
        "choices": choices(),
    }


def reconfigure() -> None:
    """Re-read ``$LORAFUSE_CPU_LOW_PRECISION`` into the loaded C++ extension (see
    :func:`lorafuse._ext.reconfigure`); the Python side reads it on every call already."""
    _ext.reconfigure()
