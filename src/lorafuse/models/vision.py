"""``FastVisionModel``: load a local vision-language model (Qwen2-VL / Qwen2.5-VL, Idefics3 /
SmolVLM, any ``AutoModelForImageTextToText`` dir) with its processor, add LoRA, patch it.

    model, processor = FastVisionModel.from_pretrained("path/to/qwen2-vl", load_in_4bit=True)
    model = FastVisionModel.get_peft_model(model, r=16)          # LoRA on the language model
    model = FastVisionModel.get_peft_model(model, finetune_vision=True, train_projector=True)

What trains: LoRA on the language model's attention and MLP projections by default; the vision
encoder stays frozen unless ``finetune_vision=True`` (LoRA on its attention and MLP linears); the
projector (Qwen's merger, Idefics3's connector) trains in full with ``train_projector=True``
(PEFT ``modules_to_save``). Every LoRA Linear runs the fused op, and the decoder gets the
Llama-family fast paths where it is one (:mod:`lorafuse.patching.fast_paths`; the report says what
stays stock and how the rope variant is handled).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from lorafuse.models import preflight
from lorafuse.models.attach import LoraTargets, announce, attach_lora, require_base
from lorafuse.models.fast_model import (
    FastLanguageModel,
    apply_heap_policy,
    load_hf_weights,
    quantize_linears,
)
from lorafuse.models.loaded import LoadedModel
from lorafuse.models.source import resolve_model_source, say
from lorafuse.models.vision_processor import VisionModelError, is_vision_model_dir, load_processor
from lorafuse.patching import decoding, mixers

LANGUAGE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The vision towers' attention / MLP linears: SigLIP (Idefics3), Qwen2-VL's ViT, Qwen2.5-VL's ViT
VISION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "qkv", "proj", "fc1", "fc2",
                      "gate_proj", "up_proj", "down_proj")  # fmt: skip
_TOWERS = {"vision": ("visual", "vision_model", "vision_tower"),
           "language": ("language_model", "text_model"),
           "projector": ("merger", "connector", "multi_modal_projector")}  # fmt: skip
_BLOCKS = "(self_attn|attn|mlp)"


def towers(model) -> dict[str, str]:
    """Qualified module names of the vision tower, language model and projector of ``model``."""
    found = {}
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        for part, leaves in _TOWERS.items():
            if leaf in leaves and part not in found:
                found[part] = name
    missing = [p for p in ("vision", "language") if p not in found]
    if missing:
        raise VisionModelError(
            f"{type(model).__name__}: cannot find its {' and '.join(missing)} module(s) "
            f"(looked for {', '.join(_TOWERS['vision'] + _TOWERS['language'])})"
        )
    return found


def target_pattern(model, target_modules=None, finetune_vision=False, finetune_language=True):
    """A PEFT ``target_modules`` regex: the named projections inside the chosen towers only."""
    parts = towers(model)
    alternatives = []
    names = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    if finetune_language:
        wanted = list(target_modules or LANGUAGE_PROJECTIONS)
        alternatives.append((parts["language"], wanted))
    if finetune_vision:
        wanted = list(target_modules or VISION_PROJECTIONS)
        alternatives.append((parts["vision"], wanted))
    if not alternatives:
        raise ValueError("finetune_language=False and finetune_vision=False: nothing to train")
    regexes = []
    for prefix, wanted in alternatives:
        present = [w for w in wanted if w in names]
        if not present:
            raise ValueError(f"none of {wanted} is a linear layer of {prefix}; its linear "
                             f"layers are {sorted(names)}")  # fmt: skip
        leaves = "|".join(re.escape(w) for w in present)
        skip = parts.get("projector", "")  # the projector trains in full or not at all
        not_projector = rf"(?!{re.escape(skip.removeprefix(prefix + '.'))}\.)" if skip else ""
        # inside an attention or MLP block only (Qwen's patch_embed.proj is a Conv3d)
        regexes.append(rf"{re.escape(prefix)}\.{not_projector}(.*\.)?{_BLOCKS}\.({leaves})")
    return "|".join(f"(?:{r})" for r in regexes)


def _load_vlm(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForImageTextToText

    return load_hf_weights(model_dir, dtype, AutoModelForImageTextToText,
                           "vision-language model")  # fmt: skip


def load_vision_model(
    model_name: str,
    max_seq_length: int = 2048,
    dtype: torch.dtype | str | None = None,
    load_in_4bit: bool = False,
    device: str | torch.device | None = None,
) -> LoadedModel:
    """What :meth:`FastVisionModel.from_pretrained` loads (same arguments), as a
    :class:`LoadedModel` ``(model, processor.tokenizer, processor)``."""
    if max_seq_length < 1:
        raise ValueError(f"max_seq_length must be >= 1, got {max_seq_length}")
    t0 = time.perf_counter()
    model_dir = Path(resolve_model_source(model_name))
    if not is_vision_model_dir(model_dir):
        raise VisionModelError(
            f"{model_dir} is a text-only model (no vision_config in config.json): load it "
            "with FastLanguageModel"
        )
    device = preflight.choose_device(device)
    dtype, why = preflight.choose_dtype(device, dtype)
    config = preflight.check_config(model_dir, vision=True)
    preflight.check_weights(model_dir)
    processor = load_processor(model_dir, max_seq_length)
    model = _load_vlm(model_dir, dtype)
    quant = quantize_linears(model, dtype, device, False) if load_in_4bit else None
    model.to(device)
    mixers.install(model)  # hybrid language models: token-mixer state restarts per example
    decoding.install(model)
    n_params = sum(p.numel() for p in model.parameters())
    say(
        f"loaded vision-language model {model_dir} ({config.model_type}, "
        f"{n_params / 1e6:.1f}M params) in {time.perf_counter() - t0:.1f} s on {device}, "
        f"dtype {str(dtype).removeprefix('torch.')} ({why})"
    )
    if quant:
        say(quant)
    return LoadedModel(model, processor.tokenizer, processor)


def vision_targets(model, target_modules=None, finetune_vision=False, finetune_language=True,
                   train_projector=False) -> LoraTargets:  # fmt: skip
    """The :class:`LoraTargets` of a vision-language model: :func:`target_pattern`, the
    projector trained in full with ``train_projector``, and the report line saying what trains."""
    pattern = target_pattern(model, target_modules, finetune_vision, finetune_language)
    projector = towers(model).get("projector")
    if train_projector and projector is None:
        raise VisionModelError(f"{type(model).__name__} has no projector module to train")
    trained = ["language model" if finetune_language else None,
               "vision tower" if finetune_vision else None]  # fmt: skip
    note = (
        f"LoRA on the {' and '.join(t for t in trained if t)}"
        + (f"; projector {projector} trained in full" if train_projector else "")
        + ("; vision tower frozen" if not finetune_vision else "")
    )
    return LoraTargets(pattern, modules_to_save=[projector.rsplit(".", 1)[-1]]
                       if train_projector else None, notes=[note])  # fmt: skip


class FastVisionModel:
    """The vision-language sibling of :class:`FastLanguageModel` (static methods only)."""

    @staticmethod
    def from_pretrained(
        model_name: str,
        max_seq_length: int = 2048,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = False,
        device: str | torch.device | None = None,
    ):
        """``(model, processor)`` from a local HF dir of a vision-language model.

        ``load_in_4bit``: NF4 base weights for every Linear (vision tower and projector too)
        except the lm_head. ``dtype=None`` picks as :class:`FastLanguageModel` does.
        ``model.max_seq_length`` is set as :class:`FastLanguageModel` sets it.
        """
        model, _, processor = load_vision_model(
            model_name, max_seq_length, dtype, load_in_4bit, device
        )
        model.max_seq_length = max_seq_length
        return model, processor

    @staticmethod
    def get_peft_model(
        model,
        r: int = 16,
        target_modules: list[str] | None = None,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        finetune_vision: bool = False,
        finetune_language: bool = True,
        train_projector: bool = False,
        use_gradient_checkpointing: bool | str = True,
        random_state: int = 3407,
        cpu_heap_policy: bool = True,
        **lora_options,
    ):
        """A PEFT LoRA model on ``model``'s chosen towers, patched onto lorafuse's fused ops
        (:func:`lorafuse.models.attach.attach_lora`).

        ``target_modules``: projection names (default: the language model's attention + MLP,
        and with ``finetune_vision`` the vision tower's); they apply inside the chosen towers
        only, never to the projector, which ``train_projector`` trains in full.
        ``cpu_heap_policy``: as :meth:`FastLanguageModel.get_peft_model`.
        """
        require_base(model)
        targets = vision_targets(model, target_modules, finetune_vision, finetune_language,
                                 train_projector)  # fmt: skip
        device = next(model.parameters()).device
        peft_model, report = attach_lora(
            model, targets, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
            gradient_checkpointing=use_gradient_checkpointing, seed=random_state, **lora_options,
        )  # fmt: skip
        if cpu_heap_policy and device.type == "cpu":
            apply_heap_policy(report)
        announce(peft_model, report)
        return peft_model

    # Eval mode + KV cache / train mode + checkpointing: the same switches as text models'.
    for_inference = staticmethod(FastLanguageModel.for_inference)
    for_training = staticmethod(FastLanguageModel.for_training)
