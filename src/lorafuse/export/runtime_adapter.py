"""A PEFT LoRA adapter as the plain (A, scaled B) pairs that deployment runtimes apply at run time
(ONNX Runtime GenAI's adapter files, OpenVINO GenAI's ``Adapter``).

Both runtimes add ``x @ A.T @ B'.T`` to each adapted Linear with no per-module scale of their own
(ONNX Runtime: none at all; OpenVINO GenAI: one ``alpha`` per adapter, set by the caller), so
PEFT's per-module scale ``s = alpha_m / r_m`` (``alpha_m / sqrt(r_m)`` with rsLoRA, rank_pattern
and alpha_pattern included) is folded into B here: ``B' = s * B``, computed in fp32. Anything
that is not such a pair is refused with the reason (a merged export carries it): DoRA, trained
biases, full-weight copies (modules_to_save), embedding LoRA, fan_in_fan_out (Conv1D) layouts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafuse.errors import LorafuseError
from lorafuse.export.merge import read_adapter

# LoraConfig options a runtime adapter cannot carry: (field, value that is harmless)
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None,
                "trainable_token_indices": None, "layer_replication": None,
                "alora_invocation_tokens": None, "target_parameters": None, "use_qalora": False,
                "fan_in_fan_out": False}  # fmt: skip


@dataclass
class LoraPair:
    """One adapted Linear: ``y += x @ A.T @ B.T`` with PEFT's scale already in B (fp32)."""

    A: torch.Tensor  # (r, in)
    B: torch.Tensor  # (out, r), scaled


def read_lora_pairs(adapter_dir: str | os.PathLike, fmt: str) -> dict[str, LoraPair]:
    """{module name (``model.layers.0.self_attn.q_proj``): LoraPair}; ``fmt`` names the output
    format in the refusal messages."""
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file():
        raise LorafuseError(f"{adapter_dir}: not a PEFT adapter dir (no adapter_config.json)")
    cfg = json.loads(cfg_path.read_text())
    for field, harmless in _UNSUPPORTED.items():
        value = cfg.get(field, harmless)
        if value not in (harmless, None, [], {}, False):
            what = "DoRA (use_dora)" if field == "use_dora" else f"{field}={value!r}"
            raise LorafuseError(
                f"{adapter_dir}: {what} cannot be expressed as a {fmt} adapter (plain LoRA "
                "pairs only); export the merged model instead"
            )
    deltas, replace = read_adapter(adapter_dir)
    if replace:
        raise LorafuseError(
            f"{adapter_dir}: tensor {sorted(replace)[0]} is a full-weight copy or bias, which a "
            f"{fmt} adapter cannot carry; export the merged model instead"
        )
    pairs = {}
    for weight, delta in deltas.items():
        if delta.transpose or delta.magnitude is not None:  # embedding LoRA (transposed) / DoRA
            raise LorafuseError(
                f"{adapter_dir}: {weight}: only Linear LoRA pairs go into a {fmt} adapter; "
                "export the merged model instead"
            )
        pairs[weight.removesuffix(".weight")] = LoraPair(
            delta.A.float(), delta.B.float() * delta.scale
        )
    if not pairs:
        raise LorafuseError(f"{adapter_dir}: no LoRA pairs in adapter_model.safetensors")
    return pairs
