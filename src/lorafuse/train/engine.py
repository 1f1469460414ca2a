"""``train(config) -> summary``: a fine-tune, start to end.

The method's entry in the registry (:mod:`lorafuse.train.recipes`) names its trainer class; the
trainer's setup and step are :mod:`lorafuse.train.trainer` (GRPO's step:
:mod:`lorafuse.train.grpo_trainer`), the loop around the step is the shared shell of
:mod:`lorafuse.train.loop`.
"""

from __future__ import annotations

import torch

from lorafuse.train import distributed as dist
from lorafuse.train import run_dir
from lorafuse.train.config import TrainConfig
from lorafuse.train.loop import TrainingError, execute
from lorafuse.train.status import RunStatus
from lorafuse.train.trainer import INITIAL_ADAPTER, STATE_VERSION, Trainer

__all__ = ["INITIAL_ADAPTER", "STATE_VERSION", "Trainer", "TrainingError", "train"]


def train(cfg: TrainConfig) -> dict:
    """Fine-tune per ``cfg``; returns the summary (loss, tokens/s, adapter path...)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    ctx = dist.setup(cfg.strategy, device=cfg.device)
    main = dist.is_main(ctx)
    try:
        # locked for the whole run; a run already there is refused unless resume / overwrite
        with run_dir.claim(cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite,
                           enabled=main):  # fmt: skip
            trainer: Trainer = cfg.recipe.trainer()(cfg, ctx)  # the method's trainer class
            # setup + the shared loop, status.json throughout
            return execute(trainer, RunStatus(cfg.output_dir, enabled=main))
    finally:
        dist.cleanup(ctx)
