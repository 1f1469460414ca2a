"""Optimizer and learning-rate schedule.

AdamW runs as PyTorch's fused kernel where the device supports it (CUDA, and CPU since torch 2.4),
else ``foreach``; the choice is returned so the trainer prints it. ``adamw_8bit`` uses bitsandbytes'
blockwise 8-bit AdamW and stops with a clear message when bitsandbytes cannot run here.
Schedules: linear warmup from 0, then cosine to 0, linear to 0, or constant.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from lorafuse.errors import ConfigError

if TYPE_CHECKING:  # the config imports the registry, which loads the trainer and us
    from lorafuse.train.config import TrainConfig

LORAPLUS_LR_EMBEDDING = 1e-6  # PEFT's create_loraplus_optimizer default for Embedding LoRA


def loraplus_groups(cfg: TrainConfig, named: list[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """LoRA+ parameter groups, as PEFT's ``create_loraplus_optimizer`` forms them.

    ``lora_B`` weights and every 1-D parameter (DoRA magnitudes, ``lora_bias``) learn at
    ``lr * loraplus_lr_ratio``, the rest of the adapter at ``lr``, Embedding LoRA at 1e-6; B
    parameters named ``bias`` get no weight decay. (PEFT's weight decay is its own
    ``loraplus_weight_decay``; here it is ``weight_decay``, as Transformers' Trainer passes it.)
    """
    lr, wd, ratio = cfg.lr, cfg.weight_decay, cfg.loraplus_lr_ratio
    a, emb, b, b_no_decay = [], [], [], []
    for name, p in named:
        if "lora_embedding_" in name:
            emb.append(p)
        elif "lora_B" in name or p.ndim == 1:
            (b_no_decay if "bias" in name else b).append(p)
        else:
            a.append(p)
    groups = [
        {"params": a, "weight_decay": wd, "lr": lr},
        {"params": emb, "weight_decay": wd, "lr": LORAPLUS_LR_EMBEDDING},
        {"params": b, "weight_decay": wd, "lr": lr * ratio},
        {"params": b_no_decay, "weight_decay": 0.0, "lr": lr * ratio},
    ]
    return [g for g in groups if g["params"]]  # fixed order: optimizer state resumes by position


def build_optimizer(
    cfg: TrainConfig,
    params: list[torch.nn.Parameter],
    names: list[str] | None = None,
) -> tuple[torch.optim.Optimizer, str]:
    """``(optimizer, description)`` for the trainable ``params`` (``names``: theirs, for LoRA+)."""
    if not params:
        raise ConfigError("the model has no trainable parameters (no LoRA adapters were added)")
    kwargs = dict(
        lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    plus = ""
    # image runs (ImageTrainConfig) have no LoRA+ option: their groups are the network's own
    if getattr(cfg, "loraplus_lr_ratio", None) is not None:
        if names is None or len(names) != len(params):
            raise ConfigError("loraplus_lr_ratio: build_optimizer needs the parameters' names")
        params = loraplus_groups(cfg, list(zip(names, params, strict=True)))
        plus = f", LoRA+ (lora_B lr x {cfg.loraplus_lr_ratio:g})"
    if cfg.optimizer == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except Exception as err:  # ImportError, or a broken native library
            raise ConfigError(
                f"optimizer=adamw_8bit needs bitsandbytes, which cannot be imported here ({err}); "
                "pip install bitsandbytes (CUDA), or use optimizer=adamw"
            ) from None
        return bnb.optim.AdamW8bit(params, **kwargs), f"AdamW 8-bit (bitsandbytes, blockwise){plus}"
    try:
        opt = torch.optim.AdamW(params, fused=True, **kwargs)
        return opt, f"AdamW (fused){plus}"
    except (RuntimeError, TypeError) as err:  # device / dtype without a fused kernel
        opt = torch.optim.AdamW(params, foreach=True, **kwargs)
        return opt, f"AdamW (foreach; fused unavailable: {err}){plus}"


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    if cfg.warmup_steps > 0:
        return cfg.warmup_steps
    return int(math.ceil(cfg.warmup_ratio * total_steps))


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based: the lr the step will use)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    cfg: TrainConfig, optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warm = warmup_steps(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warm, cfg.lr_scheduler)
    )
