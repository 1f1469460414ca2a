"""Fold LoRA on parameters (PEFT's ``ParamWrapper``: routed experts' fused 3-D tensors, routers'
2-D weights) into the base checkpoint, for :func:`lorafuse.export.merge.merge_adapter`.

Such an adapter stores ``<module>.lora_A.weight`` (E·r, in) and ``lora_B.weight`` (out, r·E) per
targeted *parameter*; several parameters of one module nest their wrappers, so the keys read
``mlp.experts.lora_A`` and ``mlp.experts.base_layer.lora_A`` and only PEFT's nesting order says
which parameter each adapts. That order, each wrapper's scaling (rank / alpha patterns, rsLoRA)
and its layout come from PEFT itself: the adapter config is applied to the base model built on
the meta device (no weights), and every wrapper is read from there.

The delta is PEFT's ``get_delta_weight``: per expert ``s·B_e·A_e`` with ``A = a.view(E, r, in)``,
``B = b.view(out, r, E)``, laid out like the parameter ((E, out, in), or (E, in, out) for gpt-oss's
transposed experts). transformers stores many MoE checkpoints per expert (``experts.3.gate_proj.
weight``: its v4 layout) and fuses them on load; the fused delta is turned into those stored
tensors by transformers' own reverse conversion (``revert_weight_conversion``: splits, stacks and
renames, all linear, so the delta of each stored tensor is the stored form of the delta). fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lorafuse.errors import LorafuseError

_PREFIX = "base_model.model."


class DenseDelta:
    """A delta already in the stored tensor's shape: ``W' = cast(W.float() + delta, dtype)``."""

    def __init__(self, delta: torch.Tensor):
        self.delta = delta

    def apply(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if tuple(weight.shape) != tuple(self.delta.shape):
            raise LorafuseError(
                f"expert delta shape {tuple(self.delta.shape)} != base {tuple(weight.shape)}"
            )
        return (weight.float() + self.delta).to(dtype)


def targets_parameters(adapter_dir: Path) -> bool:
    """Whether the adapter's config targets parameters (``target_parameters``)."""
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return bool(cfg.get("target_parameters"))


def _meta_models(base_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)


def param_wrappers(base_dir: Path, adapter_dir: Path) -> tuple[dict, object]:
    """``({adapter module name: (parameter name, experts, swapped, scaling)}, meta base model)``:
    PEFT's own wrappers for this adapter on the base model built on the meta device."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import ParamWrapper

    try:
        wrapped, plain = _meta_models(base_dir)
        config = LoraConfig.from_pretrained(str(adapter_dir))
        config.inference_mode = True
        peft_model = get_peft_model(wrapped, config, low_cpu_mem_usage=True)
    except Exception as err:
        raise LorafuseError(
            f"cannot rebuild the expert LoRA of {adapter_dir} on {base_dir} (meta device): "
            f"{type(err).__name__}: {err}"
        ) from err
    out = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, ParamWrapper):
            param = name.removeprefix(_PREFIX).replace(".base_layer", "")
            out[name.removeprefix(_PREFIX)] = (
                f"{param}.{module.parameter_name}", module.num_experts,
                module._did_swap_in_out_features, float(module.scaling["default"]),
            )  # fmt: skip
    return out, plain


def fused_delta(A: torch.Tensor, B: torch.Tensor, experts: int, swapped: bool, scale: float):
    """PEFT's ParamWrapper delta in the parameter's layout, fp32."""
    A, B = A.float(), B.float()
    if experts == 1:  # a 2-D parameter (a router's weight): (out, in)
        return scale * (B @ A)
    a = A.reshape(experts, -1, A.shape[-1])  # (E, r, in)
    b = B.reshape(B.shape[0], -1, experts)  # (out, r, E)
    return scale * torch.einsum("ore,eri->" + ("eoi" if swapped else "eio"), b, a)


def expert_deltas(base_dir: Path, adapter_dir: Path, deltas: dict) -> dict[str, DenseDelta]:
    """Take the ParamWrapper entries out of ``deltas`` (``read_adapter`` keys them
    ``<module>.weight``) and return them as stored-tensor deltas keyed by checkpoint name."""
    from transformers.core_model_loading import revert_weight_conversion

    wrappers, plain = param_wrappers(base_dir, adapter_dir)
    fused = {}
    for module, (param, experts, swapped, scale) in wrappers.items():
        lora = deltas.pop(f"{module}.weight", None)
        if lora is None:
            raise LorafuseError(f"{adapter_dir}: no LoRA weights for {module} ({param})")
        fused[param] = fused_delta(lora.A, lora.B, experts, swapped, scale)
    stored = revert_weight_conversion(plain, dict(fused))  # checkpoint names and layouts
    return {name: DenseDelta(t.contiguous()) for name, t in stored.items()}
