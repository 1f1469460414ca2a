"""Model + LoRA for training, from a :class:`TrainConfig`.

``fused=True`` (default) goes through :class:`lorafuse.FastLanguageModel` (fused kernels, the
patch report on stderr); ``fused=False`` builds the same LoRA with stock PEFT and no patching, the
baseline the fused path must match.
"""

from __future__ import annotations

import torch

from lorafuse.dtypes import parse_dtype
from lorafuse.train.config import TrainConfig, parse_pattern


def load_model(cfg: TrainConfig, device: torch.device | None = None):
    """``(model, tokenizer)`` of the frozen base model on ``device`` (config's model, dtype, 4 bit)."""
    from lorafuse import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=cfg.model,
        max_seq_length=cfg.max_seq_length,
        dtype=parse_dtype(cfg.dtype),
        load_in_4bit=cfg.load_in_4bit,
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
    return dict(
        use_rslora=cfg.use_rslora,
        init_lora_weights=True if init == "default" else init,
        lora_bias=cfg.lora_bias,
        rank_pattern=parse_pattern(cfg.rank_pattern, "rank_pattern"),
        alpha_pattern=parse_pattern(cfg.alpha_pattern, "alpha_pattern"),
    )


def add_lora(cfg: TrainConfig, model):
    """Wrap the base model with LoRA adapters (seeded init, so runs are reproducible)."""
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
            **lora_options(cfg),
        )
    from peft import LoraConfig, get_peft_model

    from lorafuse.models.fast_model import _resolve_targets

    torch.manual_seed(cfg.seed)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=_resolve_targets(model, cfg.target_modules),
        task_type="CAUSAL_LM",
        **lora_options(cfg),
    )
    return get_peft_model(model, lora)
