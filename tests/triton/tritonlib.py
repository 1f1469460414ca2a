"""Helpers for the Triton kernel tests: interpreter setup, torch references, bf16 tolerances.

Real kernels run on CUDA; without CUDA they run in Triton's interpreter. ``@triton.jit`` decides
between compiling and interpreting when it decorates, so importing this module imports
``lorafuse.triton.*`` with ``TRITON_INTERPRET=1`` set (reloading any module imported earlier
without it, ``_common`` first since it holds jit helpers) and then restores the environment. The
variable is set again only while each test runs (the ``interpret_on_cpu`` fixture, which every
test module uses), so the rest of the session never sees it: ``backends.triton_runs_on('cpu')``
stays False and other op tests do not add an interpreted Triton backend to their parameters.
Triton itself is imported here before the variable is set, so a run of these tests alone sees
what a full session sees (transformers or torch._dynamo imported triton earlier): Triton's own
jit-written library functions are compiled-mode objects, which the kernels therefore avoid.

The references are the ops' own torch functions (``lorafuse.ops.<op>._torch_forward`` /
``_torch_backward``), which every backend must match.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F
import triton  # noqa: F401  first import WITHOUT the interpreter, as in a full test session (see below)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")  # CPU runs the kernels in Triton's interpreter
BF16_ULP = 2.0**-8  # spacing of bf16 numbers in [1, 2): one rounding is at most half of it
MODULES = ("_common", "lora_linear", "rms_norm", "rope", "swiglu", "cross_entropy", "lora_conv",
           "dora", "gated_delta", "causal_conv1d", "moe_lora_kernels", "moe_lora")  # fmt: skip


def _import_kernels(interpret: bool) -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in MODULES:
            full = f"lorafuse.triton.{name}"
            if full in sys.modules:
                importlib.reload(sys.modules[full])
            else:
                importlib.import_module(full)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_kernels(interpret=not CUDA)


@pytest.fixture
def interpret_on_cpu(monkeypatch):
    """On CPU, let backends.select('triton') accept CPU tensors for the duration of one test."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def assert_lowp_close(close, actual, oracle, *, ulps: float, name: str):
    """``actual`` (bf16/fp16) against an fp32 ``oracle`` computed from the same low-precision inputs.

    Each rounding to bf16 moves a value by at most half an ulp (2^-9 relative); ``ulps`` counts the
    roundings the reference itself performs on the way (each call site says which). The absolute
    part, ``ulps`` ulps of the largest oracle element, covers entries that are small only because
    of cancellation, whose rounding error is relative to the terms summed, not to the result.
    """
    scale = float(oracle.detach().abs().max()) if oracle.numel() else 0.0
    close(actual.float(), oracle.float(), atol=ulps * BF16_ULP * scale + 1e-6,
          rtol=ulps * BF16_ULP, name=name)  # fmt: skip


def rope_forward_ref(q, k, cos, sin):
    """out = t·cos + rotate_half(t)·sin, math in fp32, outputs in q's/k's dtype."""
    from lorafuse.ops import rope

    return rope._torch_forward(q, k, cos, sin)


def ce_chunk_ref(logits, targets, ignore_index, grad_scale):
    """The chunk kernel's math through autograd: (loss (n,), grad (n, V)), ``logits`` untouched."""
    leaf = logits.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(leaf, targets, ignore_index=ignore_index, reduction="none")
    (loss.sum() * grad_scale).backward()
    return loss.detach(), leaf.grad


def reference(op: str):
    """``(forward, backward)`` of the torch reference for ``op`` (lora_linear, rms_norm, swiglu)."""
    module = importlib.import_module(f"lorafuse.ops.{op}")
    return module._torch_forward, module._torch_backward
