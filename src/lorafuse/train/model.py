"""Model + LoRA for training, from a :class:`TrainConfig`.

Loading returns a :class:`~lorafuse.models.loaded.LoadedModel`; attaching goes through
:func:`lorafuse.models.attach.attach_lora`, as ``FastLanguageModel`` / ``FastVisionModel`` do:
``fused=True`` (default) patches onto the fused kernels and returns the patch report;
``fused=False`` builds the same LoRA with stock PEFT and no patching, the baseline the fused path
must match.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lorafuse.dtypes import parse_dtype
from lorafuse.train.options import parse_pattern

if TYPE_CHECKING:  # the config imports the registry, which loads the trainer and us
    from lorafuse.models.loaded import LoadedModel
    from lorafuse.train.config import TrainConfig


def load_for_training(cfg: TrainConfig, device: torch.device | None = None) -> LoadedModel:
    """:class:`LoadedModel` ``(model, tokenizer, processor)`` of the frozen base model on
    ``device`` (config's model, dtype, 4 bit); ``processor`` only for a vision-language model."""
    from lorafuse.models.fast_model import load_language_model
    from lorafuse.models.source import resolve_model_source
    from lorafuse.models.vision import load_vision_model
    from lorafuse.models.vision_processor import is_vision_model_dir

    device = device if device is not None else cfg.device
    if cfg.model is not None and is_vision_model_dir(resolve_model_source(cfg.model)):
        loaded = load_vision_model(
            cfg.model, max_seq_length=cfg.max_seq_length, dtype=parse_dtype(cfg.dtype),
            load_in_4bit=cfg.load_in_4bit, device=device,
        )  # fmt: skip
        loaded.model.config.use_cache = False
        return loaded
    loaded = load_language_model(
        cfg.model, max_seq_length=cfg.max_seq_length, dtype=parse_dtype(cfg.dtype),
        load_in_4bit=cfg.load_in_4bit, load_in_int8=cfg.load_in_int8,
        quantize_embeddings=cfg.quantize_embeddings, device=device,
    )  # fmt: skip
    tokenizer = loaded.tokenizer
    if tokenizer.pad_token_id is None:  # padding rows only; pad tokens are never attended/learned
        tokenizer.pad_token = tokenizer.eos_token
    loaded.model.config.use_cache = False  # training: no KV cache
    return loaded


def lora_options(cfg: TrainConfig) -> dict:
    """The ``peft.LoraConfig`` fields beyond r / alpha / dropout / targets, from the config."""
    init = cfg.init_lora_weights
    extra = {}
    if init == "eva":  # the SVD itself runs once the training rows exist (lorafuse.train.eva)
        from peft import EvaConfig

        extra["eva_config"] = EvaConfig()
    return dict(
        **extra,
        use_rslora=cfg.use_rslora,
        init_lora_weights=True if init == "default" else init,
        lora_bias=cfg.lora_bias,
        use_dora=cfg.use_dora,
        rank_pattern=parse_pattern(cfg.rank_pattern, "rank_pattern"),
        alpha_pattern=parse_pattern(cfg.alpha_pattern, "alpha_pattern"),
    )


def add_lora(cfg: TrainConfig, model, processor=None):
    """``(peft_model, report)``: the config's LoRA on the base model
    (:func:`lorafuse.models.attach.attach_lora`; a vision-language model, one with a
    ``processor``, on the towers the config names). ``cfg.fused=False``: the stock PEFT baseline,
    report None."""
    from lorafuse.models.attach import attach_lora

    options = lora_options(cfg)
    if processor is not None:
        from lorafuse.models.vision import vision_targets

        targets = vision_targets(model, cfg.target_modules, cfg.finetune_vision,
                                 train_projector=cfg.train_projector)  # fmt: skip
    else:
        from lorafuse.models.fast_model import language_targets

        targets = language_targets(
            model, cfg.target_modules, cfg.expert_lora, cfg.lora_dropout, options
        )
    return attach_lora(
        model, targets, r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        gradient_checkpointing=cfg.gradient_checkpointing, seed=cfg.seed, fused=cfg.fused,
        **options,
    )  # fmt: skip
