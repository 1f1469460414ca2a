"""The RLOO trainer: GRPO's trainer (rollouts, rewards, checkpoints) with RLOO's advantages.

Per generation batch: π_old is scored whenever the KL penalty needs it (``beta > 0``) or the batch
serves several steps, π_ref (the adapter disabled) when ``beta > 0``; the rewards lose
``β Σ_t (log π_old - log π_ref)`` and get leave-one-out advantages (:mod:`lorafuse.train.rloo`).
"""

from __future__ import annotations

import torch

from lorafuse.train.grpo import Sample
from lorafuse.train.grpo_trainer import GRPOTrainer
from lorafuse.train.rloo import kl_penalty, rloo_advantages


class RLOOTrainer(GRPOTrainer):
    def needs_old_logps(self) -> bool:
        return self.cfg.num_iterations > 1 or self.cfg.beta > 0

    def advantages(self, total: torch.Tensor, samples: list[Sample]):
        cfg, extra = self.cfg, {}
        if cfg.beta:
            kl = kl_penalty(samples)  # (N,) per completion
            total = total - cfg.beta * kl
            tokens = sum(len(s.completion_ids) for s in samples)
            extra["kl"] = float(kl.sum()) / max(tokens, 1)  # per token, as TRL logs it
            for s in samples:  # the loss has no KL term: the reference log-probs are spent
                s.ref_logps = None
        adv, zero = rloo_advantages(total, cfg.num_generations, cfg.normalize_advantages)
        return adv, zero, extra
