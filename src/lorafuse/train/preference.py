"""Preference objectives on the fused engine: DPO (sigmoid, IPO, hinge) and ORPO.

Chosen and rejected run as one batch of 2B rows (chosen first); summed response log-probs come
from the final hidden states (:mod:`lorafuse.train.logprobs`), never the logits; the reference is
the adapter disabled. Per-pair terms divide by the global number of pairs (ORPO's NLL by the
global chosen-response tokens), so accumulation gives the whole batch's gradient. The losses and
logged rewards: docs/preference.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.data.packing import Row, collate
from lorafuse.train.logprobs import head_and_decoder, peft_model, sequence_logps
from lorafuse.train.objective import Objective, ObjectiveError
from lorafuse.train.options import DPO_LOSS_TYPES

LOSS_TYPES = DPO_LOSS_TYPES
# metric sums per step, in this order (all ranks' sums are added, then divided by the pairs)
SUMS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
        "logps/rejected", "nll_loss", "log_odds_ratio")  # fmt: skip


class PreferenceError(ObjectiveError):
    """The model cannot be trained with a preference objective (the message says why)."""


# ---- losses (per pair) -----------------------------------------------------------------------
def dpo_loss(chosen, rejected, ref_chosen, ref_rejected, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_tokens=None, rejected_tokens=None):  # fmt: skip
    """Per-pair DPO loss (B,) and the rewards ``β·(log π - log π_ref)`` of both responses.

    Inputs are summed response log-probs (B,); ``*_tokens`` (B,) are the response lengths that
    ``ipo`` averages over.
    """
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        if label_smoothing:
            losses = losses - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_loss: ipo needs chosen_tokens and rejected_tokens")
        avg_c = chosen_ratio / chosen_tokens.clamp(min=1)  # (B,) per-token log-ratio
        avg_r = rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (avg_c - avg_r - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo_loss: loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for x < 0, stable on both sides of -log 2."""
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


def orpo_odds_ratio(chosen_avg, rejected_avg):
    """``(log σ(log odds ratio), log odds ratio)`` per pair from token-averaged log-probs (B,)."""
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    return F.logsigmoid(log_odds), log_odds


def collate_pairs(pairs, pad_id: int, device) -> dict[str, torch.Tensor]:
    """2B rows: the B chosen sequences, then the B rejected ones (right-padded)."""
    rows = [Row(e.input_ids, e.labels, list(range(len(e.input_ids))), 1)
            for e in [p.chosen for p in pairs] + [p.rejected for p in pairs]]  # fmt: skip
    batch = collate(rows, pad_id, packed=False)
    return {k: v.to(device) for k, v in batch.items()}


class PairObjective(Objective):
    """What every objective over chosen/rejected pairs counts the same way (DPO/ORPO, CPO/SimPO)."""

    device: torch.device

    def tokens(self, pair) -> int:
        return pair.n_tokens

    def counts(self, pairs) -> torch.Tensor:
        """This rank's ``[pairs, chosen response tokens]`` (the engine sums them over ranks)."""
        n_pairs = sum(p.n_examples for p in pairs)
        n_tok = sum(p.chosen.n_targets for p in pairs if p.n_examples)
        return torch.tensor([float(n_pairs), float(n_tok)], device=self.device)


class PreferenceObjective(PairObjective):
    """DPO or ORPO for the engine: normalisers, per-micro-batch loss, metrics."""

    def __init__(self, method: str, beta: float, loss_type: str, label_smoothing: float,
                 pad_id: int, device) -> None:  # fmt: skip
        if method not in ("dpo", "orpo"):
            raise ValueError(f"PreferenceObjective: method {method!r} is not dpo or orpo")
        self.method, self.beta, self.loss_type = method, beta, loss_type
        self.label_smoothing, self.pad_id, self.device = label_smoothing, pad_id, device

    @classmethod
    def from_config(cls, cfg, pad_id: int, device) -> PreferenceObjective:
        return cls(cfg.method, cfg.beta, cfg.loss_type, cfg.label_smoothing, pad_id, device)

    def check(self, model) -> None:
        """Fail before training when the model cannot run this objective."""
        head_and_decoder(model)
        if self.method == "dpo" and not hasattr(peft_model(model), "disable_adapter"):
            raise PreferenceError("dpo needs a PEFT model: its reference is the adapter disabled")

    # ---- what the engine calls (tokens, counts: PairObjective) ----
    def loss(self, model, pairs, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, metric sums)`` of one micro-batch; ``counts`` are the global normalisers.

        Summed over micro-batches and ranks, ``loss`` is the mean loss of the global batch.
        """
        batch = collate_pairs(pairs, self.pad_id, self.device)
        B = len(pairs)
        weight = torch.tensor([float(p.n_examples) for p in pairs], device=self.device)  # (B,)
        n_tok = (F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:] != IGNORE_INDEX).sum(1)
        n_tok = n_tok.float()  # (2B,) response tokens per row
        if self.method == "dpo":
            peft = peft_model(model)  # no DDP wrapper needed: no gradient to synchronise
            with torch.no_grad(), self._reference(peft):
                ref = sequence_logps(peft, batch)  # (2B,)
        logps = sequence_logps(model, batch)  # (2B,)
        chosen, rejected = logps[:B], logps[B:]
        sums = torch.zeros(len(SUMS), device=self.device)
        if self.method == "dpo":
            losses, r_c, r_r = dpo_loss(
                chosen, rejected, ref[:B], ref[B:], beta=self.beta, loss_type=self.loss_type,
                label_smoothing=self.label_smoothing, chosen_tokens=n_tok[:B],
                rejected_tokens=n_tok[B:],
            )  # fmt: skip
            loss = (losses * weight).sum() / counts[0]
        else:
            avg_c, avg_r = chosen / n_tok[:B].clamp(min=1), rejected / n_tok[B:].clamp(min=1)
            # padding pairs score no token (log p = 0, odds infinite): give them a finite stand-in,
            # their weight is 0 anyway (nan * 0 would still be nan)
            real = weight > 0
            avg_c, avg_r = torch.where(real, avg_c, -1.0), torch.where(real, avg_r, -1.0)
            ratio, log_odds = orpo_odds_ratio(avg_c, avg_r)
            nll = -(chosen * weight).sum()  # summed NLL of the chosen response tokens
            loss = nll / counts[1].clamp(min=1) - self.beta * (ratio * weight).sum() / counts[0]
            r_c, r_r = self.beta * avg_c.detach(), self.beta * avg_r.detach()
            sums[5] = nll.detach() / counts[1].clamp(min=1) * counts[0]  # per-pair-normalised below
            sums[6] = (log_odds.detach() * weight).sum()
        sums[0] = (r_c * weight).sum()
        sums[1] = (r_r * weight).sum()
        sums[2] = ((r_c > r_r).float() * weight).sum()
        sums[3] = (chosen.detach() * weight).sum()
        sums[4] = (rejected.detach() * weight).sum()
        return loss, sums

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Global metric sums (all micro-batches, all ranks) -> per-pair means for the log."""
        n = max(float(counts[0]), 1.0)
        out = {k: float(v) / n for k, v in zip(SUMS, sums.tolist())}
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        if self.method == "dpo":
            del out["nll_loss"], out["log_odds_ratio"]
        return out

    def _reference(self, model):
        """The reference policy: the same weights with the adapter disabled."""
        if not hasattr(model, "disable_adapter"):
            raise PreferenceError("dpo needs a PEFT model: its reference is the adapter disabled")
        return model.disable_adapter()
