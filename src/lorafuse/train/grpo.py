"""GRPO (Shao et al. 2024) with the DAPO, Dr. GRPO, CISPO and SAPO losses, as TRL's ``GRPOTrainer``
computes them.

A sample is one completion; a prompt's ``G`` completions form its group. Group-relative
advantages, the per-token clipped (or CISPO / SAPO) loss with the k3 KL to the reference (the
adapter disabled), normalised over the global batch so accumulation equals one big batch.
Micro-batch: prompts left-padded (B, P), completions right-padded (B, C); hidden states at
``P - 1 .. P + C - 2`` predict the completion. The equations: docs/grpo.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorafuse.ops.token_logprobs import token_logprobs
from lorafuse.train.logprobs import final_hidden, head_and_decoder, peft_model
from lorafuse.train.objective import Objective, ObjectiveError
from lorafuse.train.options import GRPO_LOSS_TYPES, REWARD_SCALES

LOSS_TYPES, SCALES = GRPO_LOSS_TYPES, REWARD_SCALES
# metric sums per step, in this order (divided by tokens in :meth:`metrics`); cispo logs its one
# clip ratio as TRL's ``cispo_clip_ratio``, sapo (no clip) none
SUMS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")
CLIPS = {"cispo": {"clip_ratio/high_mean": "cispo_clip_ratio"}, "sapo": {}}


@dataclass
class Sample:
    """One completion of a prompt, with everything its loss needs."""

    prompt_ids: list[int]
    completion_ids: list[int]  # ends with EOS when the model stopped; may be empty
    advantage: float
    old_logps: torch.Tensor | None = None  # (C,) π_old, num_iterations > 1
    ref_logps: torch.Tensor | None = None  # (C,) adapter disabled, beta > 0
    n_examples: int = 1  # 0 for padding

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


# ---- advantages --------------------------------------------------------------------------------


class GRPOError(ObjectiveError):
    """The model cannot be trained with GRPO (the message says why)."""


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std ignoring NaN (NaN where fewer than two values), as TRL's ``nanstd``."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim)
    var = torch.where(count > 1, var * count / (count - 1), torch.full_like(var, float("nan")))
    return var.sqrt()


def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group"):
    """``(advantages (N,), zero_std (N,) bool)`` from rewards (N,) = (prompts × ``group``,),
    NaN for a completion no reward applies to (its advantage is 0)."""
    if scale not in SCALES:
        raise ValueError(f"group_advantages: scale {scale!r} is not one of {SCALES}")
    grouped = rewards.view(-1, group)  # (prompts, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)  # (N,)
    if scale == "batch":
        std = (
            nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        )
    else:
        std = (
            nanstd(grouped, dim=1).repeat_interleave(group)
            if group > 1
            else torch.zeros_like(rewards)
        )
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


# ---- the loss ----------------------------------------------------------------------------------
def token_losses(logps, old_logps, advantages, *, epsilon: float, epsilon_high: float,
                 beta: float = 0.0, ref_logps=None, kl_correction: bool = True,
                 loss_type: str = "grpo", sapo_temperatures=(1.0, 1.05)):  # fmt: skip
    """Per-token loss (B, C), importance ratio ρ (B, C, detached) and KL (B, C) or None.

    ``logps`` / ``old_logps`` / ``ref_logps`` (B, C) fp32; ``advantages`` (B,). With
    ``kl_correction`` the KL term is weighted by ρ (TRL's default ``use_bias_correction_kl``: the
    completions were sampled from π_old; ρ = 1 in value but not in gradient). ``loss_type`` picks
    the policy term: the clipped surrogate (grpo, dapo, dr_grpo), cispo's or sapo's."""
    adv = advantages[:, None]  # (B, 1)
    ratio = torch.exp(logps - old_logps)
    if loss_type == "cispo":
        losses = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps
    elif loss_type == "sapo":
        pos, neg = sapo_temperatures
        tau = torch.where(adv > 0, pos, neg)  # (B, 1)
        losses = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
        losses = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if kl_correction:
            kl = kl * ratio
        losses = losses + beta * kl
    return losses, ratio.detach(), kl


def clip_masks(ratio, adv, loss_type: str, epsilon: float, epsilon_high: float):
    """``(low, high)`` clipped-token masks (B, C) bool as TRL counts them (cispo: ρ > ε_high
    where A > 0, in ``high``; sapo clips nothing)."""
    adv = adv[:, None]  # (B, 1)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    if loss_type == "cispo":
        return none, (ratio > epsilon_high) & (adv > 0)
    if loss_type == "sapo":
        return none, none
    return (ratio < 1 - epsilon) & (adv < 0), (ratio > 1 + epsilon_high) & (adv > 0)


def normalise(losses, mask, counts, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """This micro-batch's share of the global loss; ``counts`` = global [completions, tokens]."""
    masked = losses * mask  # (B, C)
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / counts[0]
    if loss_type in ("dapo", "cispo"):
        return masked.sum() / counts[1].clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (counts[0] * max_completion_length)
    raise ValueError(f"grpo loss_type {loss_type!r} is not one of {LOSS_TYPES}")


# ---- the model side ----------------------------------------------------------------------------
def collate_samples(samples: list[Sample], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Prompts left-padded, completions right-padded: input_ids / attention_mask (B, P + C),
    completion_ids / completion_mask (B, C); C >= 1."""
    P = max(len(s.prompt_ids) for s in samples)
    C = max(1, max(len(s.completion_ids) for s in samples))
    B = len(samples)
    ids = torch.full((B, P + C), pad_id, dtype=torch.long)  # (B, P + C)
    mask = torch.zeros((B, P + C), dtype=torch.long)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[i, P - p : P] = torch.tensor(s.prompt_ids)
        mask[i, P - p : P] = 1
        if c:
            ids[i, P : P + c] = torch.tensor(s.completion_ids)
            mask[i, P : P + c] = int(s.n_examples > 0)  # padding samples score no token
    batch = {"input_ids": ids, "attention_mask": mask, "completion_ids": ids[:, P:],
             "completion_mask": mask[:, P:]}  # fmt: skip
    return {k: v.to(device) for k, v in batch.items()}


def completion_logps(model, batch: dict[str, torch.Tensor], temperature: float = 1.0):
    """``log softmax(logits / T)`` of every completion token, (B, C) fp32 (0 where masked)."""
    hidden, head = final_hidden(model, batch["input_ids"], batch["attention_mask"])
    return hidden_logps(hidden, head, batch, temperature)


def hidden_logps(hidden, head, batch: dict[str, torch.Tensor], temperature: float = 1.0):
    """:func:`completion_logps` from the decoder's final hidden states (B, P + C, H) and the
    ``lm_head``: (B, C) fp32 (0 where masked)."""
    B, C = batch["completion_ids"].shape
    P = batch["input_ids"].shape[1] - C
    h = hidden[:, P - 1 : P - 1 + C]  # (B, C, H): position t predicts token t + 1
    targets = batch["completion_ids"].masked_fill(batch["completion_mask"] == 0, -100)  # (B, C)
    bias = head.bias
    if temperature != 1.0:
        h = h / temperature
        bias = None if bias is None else bias / temperature
    per_token = torch.arange(B * C, device=h.device)  # one "sequence" per token: (B*C,) out
    out = token_logprobs(h.reshape(B * C, -1), head.weight, targets.reshape(-1), per_token,
                         B * C, bias=bias)  # fmt: skip
    return out.view(B, C)


def pad_logps(values: list[torch.Tensor | None], C: int, device) -> torch.Tensor:
    """Per-sample (c,) log-probs -> (B, C), zero-padded."""
    out = torch.zeros((len(values), C), dtype=torch.float32, device=device)
    for i, v in enumerate(values):
        if v is not None and v.numel():
            out[i, : v.numel()] = v.to(device)
    return out


@dataclass
class GRPOObjective(Objective):
    """GRPO for the engine: global normalisers, per-micro-batch loss, metrics."""

    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: float
    max_completion_length: int
    temperature: float
    pad_id: int
    kl_correction: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)  # (A > 0, A <= 0)

    @classmethod
    def from_config(cls, cfg, pad_id: int, device) -> GRPOObjective:
        high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        return cls(cfg.loss_type, cfg.beta, cfg.epsilon, high, cfg.max_completion_length,
                   cfg.temperature, pad_id, cfg.kl_correction, device,
                   (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg))  # fmt: skip

    def check(self, model) -> None:
        head_and_decoder(model)
        if self.beta and not hasattr(peft_model(model), "disable_adapter"):
            raise GRPOError("grpo with beta > 0 needs a PEFT model: the reference is the "
                                  "adapter disabled")  # fmt: skip

    def tokens(self, sample: Sample) -> int:
        return sample.n_tokens

    def counts(self, samples: list[Sample]) -> torch.Tensor:
        """``[completions, completion tokens]`` of real samples."""
        real = [s for s in samples if s.n_examples]
        return torch.tensor([float(len(real)), float(sum(len(s.completion_ids) for s in real))],
                            device=self.device)  # fmt: skip

    @torch.no_grad()
    def logps(self, model, samples: list[Sample], reference: bool = False) -> list[torch.Tensor]:
        """Per-sample completion log-probs (c,) without gradient (π_old, or π_ref with the
        adapter disabled)."""
        batch = collate_samples(samples, self.pad_id, self.device)
        peft = peft_model(model)
        if reference:
            with peft.disable_adapter():
                lp = completion_logps(peft, batch, self.temperature)
        else:
            lp = completion_logps(peft, batch, self.temperature)
        return [lp[i, : len(s.completion_ids)].clone() for i, s in enumerate(samples)]

    def loss(self, model, samples: list[Sample], counts: torch.Tensor):
        """``(loss, metric sums)`` of one micro-batch; summed over the micro-batches of a step
        the loss is the global batch's."""
        batch = collate_samples(samples, self.pad_id, self.device)
        mask = batch["completion_mask"].float()  # (B, C)
        C = mask.shape[1]
        logps = completion_logps(model, batch, self.temperature)  # (B, C), the gradient pass
        if any(s.old_logps is None for s in samples):
            old = logps.detach()
        else:
            old = pad_logps([s.old_logps for s in samples], C, self.device)
        ref = pad_logps([s.ref_logps for s in samples], C, self.device) if self.beta else None
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=self.device)
        losses, ratio, kl = token_losses(logps, old, adv, epsilon=self.epsilon,
                                         epsilon_high=self.epsilon_high, beta=self.beta,
                                         ref_logps=ref, kl_correction=self.kl_correction,
                                         loss_type=self.loss_type,
                                         sapo_temperatures=self.sapo_temperatures)  # fmt: skip
        loss = normalise(losses, mask, counts, self.loss_type, self.max_completion_length)
        low, high = clip_masks(ratio, adv, self.loss_type, self.epsilon, self.epsilon_high)
        low, high = low.float() * mask, high.float() * mask
        kl_sum = (
            (kl.detach() * mask).sum() if kl is not None else torch.zeros((), device=self.device)
        )
        sums = torch.stack([low.sum(), high.sum(), ((low + high) > 0).float().sum(), kl_sum])
        return loss, sums

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Global sums -> token means (TRL's ``global_masked_mean``)."""
        n_tok = max(float(counts[1]), 1.0)
        out = {k: float(v) / n_tok for k, v in zip(SUMS, sums.tolist())}
        if not self.beta:
            del out["kl"]
        if self.loss_type in CLIPS:  # its own clip metric names (or none)
            names = CLIPS[self.loss_type]
            out = {names.get(k, k): v for k, v in out.items() if k == "kl" or k in names}
        return out
