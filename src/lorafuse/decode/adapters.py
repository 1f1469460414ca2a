"""The PEFT LoRA adapters of a model as the decode engine applies them: unmerged, per row.

Every adapter of a PEFT model gets an index; a row of a step names its adapter's index (-1: the
bare base) and each projection adds ``scaling · B·(A·x)`` of that adapter, one rank-r pass for
the whole batch (``csrc/decode_layer.cpp``: ``lora_down`` / ``lora_up``), so a batch mixing
adapters costs one step. A and B are the adapter's own fp32 parameters (no copy: what the
optimizer writes in place during GRPO is what the next rollout reads); other dtypes are copied
to fp32 at :func:`collect` time.

:func:`signature` identifies the tensors an engine was given, so it can re-read them when an
adapter was added, removed or its tensors replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorafuse.decode.families import Decoder


@dataclass
class LoraTensors:
    layer: int
    proj: str
    adapter: int
    A: torch.Tensor  # (r, in) fp32 contiguous
    B: torch.Tensor  # (out, r) fp32 contiguous
    scale: float


def adapter_names(model) -> list[str]:
    """The adapter names of a PEFT model, in a fixed order (none for a plain model)."""
    config = getattr(model, "peft_config", None)
    return list(config) if isinstance(config, dict) else []


def active_adapters(model) -> list[str]:
    """The adapters a forward of ``model`` would apply now: none for a plain model or where the
    adapters are disabled (PEFT's ``disable_adapter()``); PEFT may activate several at once."""
    if not adapter_names(model):
        return []
    for module in model.modules():
        if hasattr(module, "lora_A") and hasattr(module, "disable_adapters"):
            return [] if module.disable_adapters else list(module.active_adapters)
    return []


def active_adapter(model) -> str | None:
    """The one adapter a forward of ``model`` applies now (None: the bare base); the engine
    runs one adapter per row (:func:`active_adapters` says when PEFT has several on)."""
    active = active_adapters(model)
    return active[0] if active else None


def _fp32(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def collect(decoder: Decoder, names: list[str]) -> list[LoraTensors]:
    """Every (layer, projection, adapter) LoRA of ``decoder``'s layers, for adapters ``names``."""
    index = {name: i for i, name in enumerate(names)}
    out = []
    for li, layer in enumerate(decoder.layers):
        for proj, module in layer.proj.items():  # a MoE layer: attention only
            lora_A, lora_B = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
            if lora_A is None:
                continue
            for name in lora_A.keys():
                if name not in index:
                    continue
                A, B = lora_A[name].weight, lora_B[name].weight
                # a fused module's (Phi-3) adapter: this projection's rows of B, A shared; the
                # row slice is a view, so in-place updates still reach the engine
                B = B.detach()[layer.rows.get(proj, slice(None))]
                scale = float(module.scaling[name])
                out.append(LoraTensors(li, proj, index[name], _fp32(A), _fp32(B), scale))
    return out


def _copied_version(t: torch.Tensor) -> int:
    # a tensor collect() copies is stale after an in-place update; a referenced one never is
    return -1 if t.dtype == torch.float32 and t.is_contiguous() else t._version


def signature(model, decoder: Decoder) -> tuple:
    """What :func:`collect` would read: adapter names, and each LoRA parameter's storage."""
    parts = [tuple(adapter_names(model))]
    for layer in decoder.layers:
        for module in layer.proj.values():
            for params in (getattr(module, "lora_A", None), getattr(module, "lora_B", None)):
                if params is not None:
                    parts.extend((k, v.weight.data_ptr(), _copied_version(v.weight))
                                 for k, v in params.items())  # fmt: skip
            scaling = getattr(module, "scaling", None)
            if scaling:
                parts.extend(sorted(scaling.items()))
    return tuple(parts)
