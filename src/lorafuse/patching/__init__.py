"""Apply lorafuse's fused ops to a PEFT LoRA model, in place, revertibly.

``patch_peft_model(model)`` routes every eligible LoRA ``Linear`` through the fused LoRA linear
op (:mod:`.peft_lora`) and every mixture-of-experts block's experts (PEFT's ``ParamWrapper`` on
the fused 3-D expert tensors) through the fused expert op (:mod:`.moe`), then applies the per-architecture fast paths of :mod:`.fast_paths` (fused
attention, MLP, RMSNorm, RoPE and the fused linear cross-entropy loss) when the model's
architecture is in the registry. Module names and state_dict keys never change. The result is
recorded in ``model.lorafuse_report`` (:class:`PatchReport`). ``unpatch_peft_model`` restores
every replaced forward. On CPU, patching also lets glibc keep the step's freed buffers for the
next step (:mod:`lorafuse.heap`, process-wide; noted in the report).

:func:`.decoding.install` (called by ``FastLanguageModel``, no PEFT needed) routes decoding's
few-row products on plain ``nn.Linear`` layers to the decode kernel, registry models' RMSNorm to
the C++ norm and their decoding step to :mod:`.decode_step`; ``unpatch_peft_model`` restores
those forwards too. :func:`.mixers.install` (also called by ``FastLanguageModel``) gives the
hybrids' stateful token mixers example boundaries (packing and padding isolation).
"""

from __future__ import annotations

import torch
from torch import nn

from lorafuse import backends
from lorafuse.patching import mixers, moe, peft_lora
from lorafuse.patching.report import PatchReport

__all__ = ["PatchReport", "patch_peft_model", "unpatch_peft_model"]


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _backend_label(model: nn.Module, backend: str | None) -> str:
    """``"auto -> cpp (cpu)"``; raises early on a request that cannot run on this device."""
    device = _device_of(model)
    choice = backends.requested(backend)
    chosen = backends.select("lora_linear", device, backend)
    return f"{choice} -> {chosen} ({device.type})"


def _patch_lora_modules(
    model: nn.Module, backend: str | None, report: PatchReport, handled: set[str]
) -> None:
    n_dora = 0
    for name, module in model.named_modules():
        if not peft_lora.is_lora_layer(module) or name in handled:
            continue
        reason = peft_lora.static_reason(module)
        if reason is None:
            _, reason = peft_lora.adapter_reason(module)
            if reason is None and not [a for a in module.active_adapters if a in module.lora_A]:
                reason = "no active adapter on this module (PEFT runs the base layer only)"
        if reason is not None:
            report.skipped[name] = reason
            if peft_lora.is_fused_lora(module):  # patched earlier, state changed since
                peft_lora.restore_forward(module)
            continue
        module._lorafuse_name = name
        peft_lora.patch_lora_linear(module, backend)
        report.patched.append(name)
        n_dora += peft_lora.runs_dora(module)
    if n_dora:
        report.notes.append(
            f"fused DoRA on {n_dora} module(s) (lorafuse.ops.dora); inside the attention/MLP "
            "fast paths they run as their own fused DoRA Linear (lora_qkv/lora_mlp take plain "
            "LoRA projections only)"
        )


def patch_peft_model(
    model: nn.Module, backend: str | None = None, verbose: bool = False
) -> nn.Module:
    """Patch ``model`` (a ``PeftModel`` or any module holding PEFT LoRA layers) in place.

    Args:
        model: the PEFT model; returned, same object.
        backend: ``None``/``"auto"``, ``"torch"``, ``"cpp"`` or ``"triton"`` (see
            :mod:`lorafuse.backends`); ``None`` defers to ``$LORAFUSE_KERNELS``.
        verbose: print the :class:`PatchReport`.

    Patching twice is idempotent (the second call re-evaluates and refreshes the report). It
    changes the model only: the process's CPU heap policy is the run owner's call
    (:func:`lorafuse.heap.apply_training_policy`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_peft_model expects a torch.nn.Module, got {type(model).__name__}")
    if not any(peft_lora.is_lora_layer(m) for m in model.modules()):
        raise ValueError(
            f"patch_peft_model: {type(model).__name__} has no PEFT LoRA layers; wrap it with "
            "peft.get_peft_model(model, LoraConfig(...)) first"
        )
    report = PatchReport(backend=_backend_label(model, backend))
    handled = moe.apply(model, backend, report)  # experts' ParamWrappers: the fused expert op
    _patch_lora_modules(model, backend, report, handled)
    from lorafuse.patching import fast_paths  # after the generic pass: it reuses its decisions

    # example boundaries for stateful mixers; before the family fast paths, whose report names
    # the mixers still on transformers' forward
    for name, n in mixers.install(model).items():
        report.add_fast_path(name, n)
    fast_paths.apply_fast_paths(model, backend, report)
    report.notes += [f"packing not isolated: {why}" for why in mixers.unisolated(model)]
    model.lorafuse_report = report
    if verbose:
        print(report)
    return model


def unpatch_peft_model(model: nn.Module) -> nn.Module:
    """Restore every forward lorafuse replaced in ``model``; returns the model."""
    for module in model.modules():
        peft_lora.restore_forward(module)
        module.__dict__.pop("_lorafuse_name", None)
    model.__dict__.pop("lorafuse_report", None)
    return model
