"""RLOO (Ahmadian et al. 2024) on the fused engine, as TRL's ``RLOOTrainer`` computes it.

The rollouts, rewards and micro-batches are GRPO's (:mod:`lorafuse.train.grpo`,
:mod:`lorafuse.train.rloo_trainer`); what differs:

* The KL is a reward penalty, not a loss term: ``r ← r - β Σ_t (log π_old - log π_ref)`` over each
  completion's tokens (the first-order estimate, as the RLOO paper and TRL), before advantages.
* Advantages use the leave-one-out baseline: ``A_i = r_i - mean_{j ≠ i, scorable} r_j`` in each
  group (a completion no reward applies to is left out and gets 0); ``normalize_advantages``
  then standardises them over the generation batch (``(A - mean) / (std + 1e-4)``).
* The ratio is per sequence: ``ρ = exp(Σ_t log π - Σ_t log π_old)``, loss per completion
  ``-min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A)``, summed and divided by the global number of
  completions (TRL's ``per_sequence_loss.mean()`` with one micro-batch).
"""

from __future__ import annotations

import torch

from lorafuse.train.grpo import (
    GRPOObjective,
    Sample,
    collate_samples,
    completion_logps,
    nanstd,
    pad_logps,
)

SUMS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def rloo_advantages(rewards: torch.Tensor, group: int, normalize: bool = False):
    """``(advantages (N,), zero_std (N,) bool)`` from rewards (N,) = (prompts × ``group``,), NaN
    for a completion no reward applies to."""
    grouped = rewards.view(-1, group)  # (prompts, G)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)  # (prompts, 1)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    baseline = (total - grouped) / (scorable - 1)  # leave-one-out mean; 0/0 = NaN -> A = 0
    adv = (grouped - baseline).view(-1)
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (nanstd(adv) + 1e-4)
    std = nanstd(grouped, dim=1).repeat_interleave(group)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def kl_penalty(samples: list[Sample]) -> torch.Tensor:
    """(N,) ``Σ_t (log π_old - log π_ref)`` of each sample (needs both log-probs)."""
    return torch.stack([(s.old_logps - s.ref_logps).sum() for s in samples])


class RLOOObjective(GRPOObjective):
    """RLOO for the engine: GRPO's samples, a per-sequence clipped ratio, no KL in the loss."""

    def loss(self, model, samples: list[Sample], counts: torch.Tensor):
        """``(loss, metric sums)`` of one micro-batch; summed over the micro-batches of a step
        the loss is the global batch's."""
        batch = collate_samples(samples, self.pad_id, self.device)
        mask = batch["completion_mask"].float()  # (B, C)
        logps = (completion_logps(model, batch, self.temperature) * mask).sum(-1)  # (B,)
        if any(s.old_logps is None for s in samples):
            old = logps.detach()
        else:
            old = pad_logps([s.old_logps for s in samples], mask.shape[1], self.device) * mask
            old = old.sum(-1)
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=self.device)
        real = torch.tensor([float(s.n_examples > 0) for s in samples], device=self.device)
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_seq = -torch.min(ratio * adv, clipped * adv)  # (B,)
        loss = (per_seq * real).sum() / counts[0]
        r = ratio.detach()
        low = ((r < 1 - self.epsilon) & (adv < 0)).float() * real
        high = ((r > 1 + self.epsilon_high) & (adv > 0)).float() * real
        sums = torch.stack([low.sum(), high.sum(), ((low + high) > 0).float().sum()])
        return loss, sums

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Global sums -> means over completions (TRL's per-sequence clip ratios)."""
        n = max(float(counts[0]), 1.0)
        return {k: float(v) / n for k, v in zip(SUMS, sums.tolist())}
