"""Attach LoRA adapters to a loaded model: the one recipe behind ``FastLanguageModel`` /
``FastVisionModel.get_peft_model`` and ``lorafuse train`` (fused, or its stock baseline).

    peft_model, report = attach_lora(model, LoraTargets(["q_proj", "v_proj"]), r=16, seed=3407)

Fused (default): per-layer checkpointing from :mod:`lorafuse.models.grad_checkpointing` (CPU offload on
CUDA), then :func:`lorafuse.patching.patch_peft_model`; the report says what runs fused. Stock
(``fused=False``, ``lorafuse train --no-fused``): transformers' own checkpointing and plain PEFT,
nothing patched, report None: the baseline the fused path must match. Neither touches the
process's heap: whoever owns the run applies that policy (:mod:`lorafuse.heap`).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

from lorafuse.models import grad_checkpointing, nf4
from lorafuse.models.source import say
from lorafuse.patching.report import PatchReport


@dataclass
class LoraTargets:
    """Where LoRA goes (``peft.LoraConfig`` fields) and what the report adds about it."""

    modules: list[str] | str  # target_modules: names, a regex, or "all-linear"
    parameters: list[str] = field(default_factory=list)  # target_parameters: MoE expert tensors
    modules_to_save: list[str] | None = None  # trained in full (e.g. a VLM's projector)
    notes: list[str] = field(default_factory=list)  # report lines (experts left untrained, ...)


def require_base(model) -> None:
    """A ``ValueError`` where ``model`` already has adapters (LoRA goes on the base model)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        raise ValueError("model already has adapters (it is a PeftModel); pass the base model")


def attach_lora(
    model,
    targets: LoraTargets,
    *,
    r: int = 16,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    gradient_checkpointing: bool | str = True,
    seed: int = 3407,
    fused: bool = True,
    **lora_options,
):
    """``(peft_model, report)``: PEFT LoRA on ``targets`` of ``model`` (seeded init, so runs are
    reproducible); ``lora_options`` go to ``peft.LoraConfig`` as given (``bias``, ``use_dora``,
    ``rank_pattern``...). ``report`` is the :class:`PatchReport` (None when ``fused=False``)."""
    from peft import LoraConfig, get_peft_model

    require_base(model)
    if fused:
        device = next(model.parameters()).device
        grad_checkpointing.enable(
            model, grad_checkpointing.normalise_mode(gradient_checkpointing, device)
        )
    elif gradient_checkpointing:  # the baseline: transformers' own switch, as a PEFT user writes it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    torch.manual_seed(seed)  # adapter init is random: make it reproducible
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets.modules,
        target_parameters=targets.parameters or None, modules_to_save=targets.modules_to_save,
        task_type="CAUSAL_LM", **lora_options,
    )  # fmt: skip
    # QDoRA: PEFT's DoRA init reads the NF4 weights lorafuse's loader made
    with nf4.peft_dora_init() if fused and config.use_dora else contextlib.nullcontext():
        peft_model = get_peft_model(model, config)
    if not fused:
        return peft_model, None
    from lorafuse.patching import patch_peft_model

    patch_peft_model(peft_model)
    report: PatchReport = peft_model.lorafuse_report  # the documented public attribute
    report.notes.extend(targets.notes)
    return peft_model, report


def announce(model, report: PatchReport) -> None:
    """Print the patch report and the checkpointing mode (stderr), as ``get_peft_model`` does."""
    print(str(report), file=sys.stderr, flush=True)
    mode = grad_checkpointing.mode_of(model)
    if mode:
        where = ", layer inputs offloaded to CPU" if mode == "offload" else ""
        say(f"gradient checkpointing: recompute per decoder layer{where}")
