"""Checks and choices before loading a model dir: files present and readable, architecture
supported, tokenizer present; which device and dtype to use. Every error names the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lorafuse import backends, hardware
from lorafuse.dtypes import parse_dtype
from lorafuse.errors import LorafuseError
from lorafuse.models.source import ModelSourceError

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class UnsupportedModelError(LorafuseError, ValueError):
    """The model's architecture (config.json ``model_type``) cannot be loaded as a causal LM."""


def weight_files(model_dir: Path) -> list[Path]:
    found = sorted({p for pat in WEIGHT_PATTERNS for p in model_dir.glob(pat)})
    if not found:
        raise ModelSourceError(
            f"{model_dir} has a config.json but no weight files ({', '.join(WEIGHT_PATTERNS)})"
        )
    return found


def check_weights(model_dir: Path) -> None:
    """Open every safetensors header (cheap) so a truncated/corrupt file fails with its name."""
    from safetensors import safe_open

    for path in weight_files(model_dir):
        if path.suffix != ".safetensors":
            continue  # .bin files are checked by the loader; errors are wrapped with the dir name
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as err:
            raise ModelSourceError(f"corrupt weights file {path}: {err}") from err


def check_config(model_dir: Path, vision: bool = False):
    """The model's config; raises :class:`UnsupportedModelError` naming config.json and model_type.
    ``vision``: a vision-language model (``AutoModelForImageTextToText``) instead of a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    cfg_path = model_dir / "config.json"
    try:
        model_type = json.loads(cfg_path.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as err:
        raise ModelSourceError(f"cannot read {cfg_path}: {err}") from err
    if vision and model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{cfg_path}: model_type {model_type!r} is not a vision-language model this "
            "transformers version can load (AutoModelForImageTextToText)"
        )
    if not vision and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or "vision_config" in json.loads(
            cfg_path.read_text()
        ):
            raise UnsupportedModelError(
                f"{cfg_path}: model_type {model_type!r} is a vision-language model: load it with "
                "lorafuse.models.vision.FastVisionModel (lorafuse train does so by itself)"
            )
    if not vision and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{cfg_path}: model_type {model_type!r} is not a causal language model this transformers "
            "version can load (AutoModelForCausalLM); lorafuse fine-tunes decoder-only LMs"
        )
    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except Exception as err:
        raise ModelSourceError(f"invalid {cfg_path}: {type(err).__name__}: {err}") from err


def load_tokenizer(model_dir: Path, max_seq_length: int):
    """Tokenizer with ``model_max_length``, a pad token (eos if missing) and right padding."""
    from transformers import AutoTokenizer

    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise ModelSourceError(
            f"{model_dir} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}); "
            "save one next to the weights with tokenizer.save_pretrained(dir)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:
        raise ModelSourceError(
            f"cannot load the tokenizer in {model_dir}: {type(err).__name__}: {err}"
        ) from err
    tok.model_max_length = max_seq_length
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelSourceError(
                f"the tokenizer in {model_dir} has neither a pad nor an eos token"
            )
        tok.pad_token = tok.eos_token
    # Right padding for training (labels align with inputs; causal attention never sees the pads
    # of its own row); generation code switches to left padding for batched prompts itself.
    tok.padding_side = "right"
    return tok


def choose_device(device: str | torch.device | None) -> torch.device:
    """``device``, or where none is given :func:`lorafuse.hardware.default_device`."""
    return torch.device(device) if device is not None else hardware.default_device()


def choose_dtype(device: torch.device, dtype: torch.dtype | str | None) -> tuple[torch.dtype, str]:
    """(dtype, why): bf16 where native, fp16 on pre-Ampere CUDA, else fp32."""
    if dtype is not None and not (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        try:
            dtype = parse_dtype(dtype)
        except ValueError as err:
            raise ValueError(f"dtype must be a floating torch.dtype or a name: {err}") from None
        return dtype, "as requested"
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8:
            return torch.bfloat16, f"CUDA compute capability {major}.x runs bf16 natively"
        return torch.float16, f"CUDA compute capability {major}.x has no native bf16"
    if device.type == "cpu" and backends.native_low_precision_matmul(device, torch.bfloat16):
        return torch.bfloat16, "this CPU has AVX-512-BF16/AMX"
    return (
        torch.float32,
        f"no native bf16 matrix units on this {device.type} (bf16 would be ~100x slower)",
    )
