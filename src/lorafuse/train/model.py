"""Model + LoRA for training, from a :class:`TrainConfig`.

``fused=True`` (default) goes through :class:`lorafuse.FastLanguageModel` (fused kernels, the
patch report on stderr); ``fused=False`` builds the same LoRA with stock PEFT and no patching, the
baseline the fused path must match.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lorafuse.dtypes import parse_dtype
from lorafuse.train.options import parse_pattern

if TYPE_CHECKING:  # the config imports the registry, which loads the trainer and us
    from lorafuse.train.config import TrainConfig


def load_model(cfg: TrainConfig, device: torch.device | None = None):
    """``(model, tokenizer)`` of the frozen base model on ``device`` (config's model, dtype, 4 bit)."""
    from lorafuse import FastLanguageModel
    from lorafuse.models.loader import resolve_model_source
    from lorafuse.models.vision import FastVisionModel
    from lorafuse.models.vision_processor import is_vision_model_dir

    if cfg.model is not None and is_vision_model_dir(resolve_model_source(cfg.model)):
        model, processor = FastVisionModel.from_pretrained(
            cfg.model, max_seq_length=cfg.max_seq_length, dtype=parse_dtype(cfg.dtype),
            load_in_4bit=cfg.load_in_4bit, device=device if device is not None else cfg.device,
        )  # fmt: skip
        model.lorafuse_processor = processor  # the trainer's data and checkpoints use it
        model.config.use_cache = False
        return model, processor.tokenizer
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=cfg.model,
        max_seq_length=cfg.max_seq_length,
        dtype=parse_dtype(cfg.dtype),
        load_in_4bit=cfg.load_in_4bit,
        load_in_int8=cfg.load_in_int8,
        quantize_embeddings=cfg.quantize_embeddings,
        device=device if device is not None else cfg.device,
    )
    if tokenizer.pad_token_id is None:  # padding rows only; pad tokens are never attended/learned
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False  # training: no KV cache
    return model, tokenizer


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


def add_lora(cfg: TrainConfig, model):
    """Wrap the base model with LoRA adapters (seeded init, so runs are reproducible)."""
    if getattr(model, "lorafuse_processor", None) is not None:
        return _add_vision_lora(cfg, model)
    if cfg.fused:
        from lorafuse import FastLanguageModel

        return FastLanguageModel.get_peft_model(
            model,
            r=cfg.lora_r,
            target_modules=cfg.target_modules,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            use_gradient_checkpointing=cfg.gradient_checkpointing,
            random_state=cfg.seed,
            expert_lora=cfg.expert_lora,
            **lora_options(cfg),
        )
    from peft import LoraConfig, get_peft_model

    from lorafuse.models import moe_targets
    from lorafuse.models.fast_model import lora_targets

    torch.manual_seed(cfg.seed)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    targets, experts = lora_targets(model, cfg.target_modules, cfg.expert_lora)
    moe_targets.check_options(experts, cfg.lora_dropout, lora_options(cfg))
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        target_parameters=experts.target_parameters or None,
        task_type="CAUSAL_LM",
        **lora_options(cfg),
    )
    return get_peft_model(model, lora)


def _add_vision_lora(cfg: TrainConfig, model):
    """A vision-language model's LoRA: the towers and projector the config names."""
    from lorafuse.models.vision import FastVisionModel, target_pattern, towers

    options = lora_options(cfg)
    if cfg.fused:
        return FastVisionModel.get_peft_model(
            model, r=cfg.lora_r, target_modules=cfg.target_modules, lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout, finetune_vision=cfg.finetune_vision,
            train_projector=cfg.train_projector, use_gradient_checkpointing=cfg.gradient_checkpointing,
            random_state=cfg.seed, **options,
        )  # fmt: skip
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(cfg.seed)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    projector = towers(model).get("projector") if cfg.train_projector else None
    lora = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        target_modules=target_pattern(model, cfg.target_modules, cfg.finetune_vision),
        modules_to_save=[projector.rsplit(".", 1)[-1]] if projector else None,
        task_type="CAUSAL_LM", **options,
    )  # fmt: skip
    return get_peft_model(model, lora)
