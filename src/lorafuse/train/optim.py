"""Optimizer and learning-rate schedule.

AdamW runs as PyTorch's fused kernel where the device supports it (CUDA, and CPU since torch 2.4),
else ``foreach``; the choice is returned so the trainer prints it. ``adamw_8bit`` uses bitsandbytes'
blockwise 8-bit AdamW and stops with a clear message when bitsandbytes cannot run here.
Schedules: linear warmup from 0, then cosine to 0, linear to 0, or constant.
"""

from __future__ import annotations

import math

import torch

from lorafuse.train.config import ConfigError, TrainConfig


def build_optimizer(
    cfg: TrainConfig, params: list[torch.nn.Parameter]
) -> tuple[torch.optim.Optimizer, str]:
    """``(optimizer, description)`` for the trainable ``params``."""
    if not params:
        raise ConfigError("the model has no trainable parameters (no LoRA adapters were added)")
    kwargs = dict(
        lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    if cfg.optimizer == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except Exception as err:  # ImportError, or a broken native library
            raise ConfigError(
                f"optimizer=adamw_8bit needs bitsandbytes, which cannot be imported here ({err}); "
                "pip install bitsandbytes (CUDA), or use optimizer=adamw"
            ) from None
        return bnb.optim.AdamW8bit(params, **kwargs), "AdamW 8-bit (bitsandbytes, blockwise)"
    try:
        opt = torch.optim.AdamW(params, fused=True, **kwargs)
        return opt, "AdamW (fused)"
    except (RuntimeError, TypeError) as err:  # device / dtype without a fused kernel
        opt = torch.optim.AdamW(params, foreach=True, **kwargs)
        return opt, f"AdamW (foreach; fused unavailable: {err})"


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
