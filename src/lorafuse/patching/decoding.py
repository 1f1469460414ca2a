"""Decoding on CPU: the per-token work of a bf16 / fp16 model through kernels made for one row.

* Every plain ``nn.Linear`` gets an instance forward that sends a few rows without a gradient to
  carry through :mod:`lorafuse.ops.decode_linear` (where
  :func:`~lorafuse.ops.decode_linear.applies`), and everything else (prefill, training, fp32,
  CUDA, torch.compile) through ``F.linear``. PEFT's LoRA layers call their base layer, so adapters
  keep working.
* The RMSNorm layers of the registry's architectures (:data:`lorafuse.patching.registry.REGISTRY`:
  HF Llama semantics) run the C++ norm's forward where no gradient is wanted: one call instead of
  the eight small ops of ``LlamaRMSNorm.forward``, which took ~10% of a SmolLM2-135M bf16 token
  (py-spy, 1 thread).
* The registry's ``<Arch>Model`` runs a plain decoding step through
  :mod:`lorafuse.patching.decode_step` (the layers in one Python loop, transformers' math op for
  op) unless the model has forward hooks.

The row limits and the kernels are chosen once, when :func:`install` runs
(``FastLanguageModel.from_pretrained`` and ``for_inference`` call it): looked up per call they cost
~4 µs of a ~16 µs layer call, ~7% of a token. :func:`uninstall` (or ``unpatch_peft_model``)
restores the stock forwards.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from lorafuse.ops import decode_linear as op
from lorafuse.ops.rms_norm import no_grad_cpp_chosen, rms_norm_no_grad_cpp
from lorafuse.patching import decode_step
from lorafuse.patching.peft_lora import (
    install_forward,
    is_installed,
    original_forward,
    restore_forward,
)
from lorafuse.patching.registry import REGISTRY


def _linear_forward(limits, self: nn.Linear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    # Under torch.compile the graph keeps F.linear: the kernel is no custom op (decoding is eager).
    if (
        not args
        and not kwargs
        and not torch.compiler.is_compiling()
        and op.applies(x, self.weight, self.bias, limits.get(x.dtype, 0))
    ):
        return op.decode_linear(x, self.weight, self.bias)
    return original_forward(self, x, *args, **kwargs)


def _rms_norm_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    w = self.weight
    if (
        not args
        and not kwargs
        and not torch.compiler.is_compiling()
        and x.is_cpu
        and x.dtype == w.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    ):
        return rms_norm_no_grad_cpp(x, w, self.variance_epsilon)
    return original_forward(self, x, *args, **kwargs)


def _low_precision_cpu(model: nn.Module) -> bool:
    return any(p.device.type == "cpu" and p.dtype in op.LOW_PRECISION for p in model.parameters())


def _registry_class(model: nn.Module, suffix: str, part: str) -> tuple[type, ...]:
    """``(<Arch><suffix>,)`` for a model of the registry whose spec has ``part``, else ``()``."""
    spec = REGISTRY.get(getattr(getattr(model, "config", None), "model_type", None))
    if spec is None or part not in spec.parts or (part == "rms_norm" and spec.norm != "llama"):
        return ()  # a norm rounded once after an fp32 weight is not the Llama-semantics kernel
    cls = spec.cls(suffix)
    return () if cls is None else (cls,)


def install(model: nn.Module) -> int:
    """Route ``model``'s plain ``nn.Linear`` layers (and, on a bf16 / fp16 CPU model of the
    registry, its RMSNorm layers and its decoding step) through the decoding kernels; returns how
    many modules it routed now (idempotent). With bf16 / fp16 weights on CPU the kernels are chosen here, so a first-use
    build of the C++ extension happens while the model loads, not at the first generated token;
    fp32 models never build it here."""
    low_precision = _low_precision_cpu(model)
    limits = op.row_limits() if low_precision else {}
    norms = _registry_class(model, "RMSNorm", "rms_norm") if low_precision else ()
    if norms and not no_grad_cpp_chosen():
        norms = ()
    steps = (
        ()
        if not limits or decode_step.has_hooks(model)
        else _registry_class(model, "Model", "decode_step")
    )
    linear_forward = functools.partial(_linear_forward, limits)
    model_forward = functools.partial(decode_step.model_forward, limits)
    count = 0
    for module in model.modules():
        if is_installed(module):
            continue
        if type(module) is nn.Linear:
            install_forward(module, linear_forward, None)
        elif type(module) in norms:
            install_forward(module, _rms_norm_forward, None)
        elif type(module) in steps:
            install_forward(module, model_forward, None)
        else:
            continue
        count += 1
    return count


def uninstall(model: nn.Module) -> int:
    """Restore the stock forward of every layer :func:`install` routed; returns how many."""
    routed = (_linear_forward, _rms_norm_forward, decode_step.model_forward)
    count = 0
    for module in model.modules():
        fn = getattr(
            getattr(module.__dict__.get("forward"), "__func__", None), "_lorafuse_fn", None
        )
        if getattr(fn, "func", fn) in routed:
            count += restore_forward(module)
    return count
