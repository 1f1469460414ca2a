"""CPO and SimPO on the fused engine, as TRL's ``CPOTrainer`` (``trl.experimental.cpo``) computes
them: preference losses with no reference model.

Per pair, from the policy's log-probs of the chosen and rejected responses (summed over the
response tokens; token-averaged for ``ipo`` and ``simpo``), ``Δ = log π(y_w) - log π(y_l)``:

* sigmoid (CPO paper, Eq. 3): ``-(1-ε) log σ(βΔ) - ε log σ(-βΔ)``;
* hinge: ``relu(1 - βΔ)``;  ipo: ``(Δ - 1/(2β))²``;
* simpo (SimPO paper, Eq. 6): the sigmoid loss of ``Δ - γ/β`` (γ = ``simpo_gamma``, the target
  reward margin; ε as above);

plus ``α · NLL(y_w)``, the chosen responses' mean token NLL (``cpo_alpha``: 1 for ``cpo``, 0 for
``simpo``; SimPO with α > 0 is TRL's CPO-SimPO). Per-pair terms are divided by the global number
of pairs, the NLL by the global number of chosen response tokens, so gradient accumulation gives
the big batch's gradient; with one micro-batch it is TRL's ``losses.mean() + cpo_alpha * nll``.
Rewards logged as TRL does: ``β · log π`` (the same average or sum as the loss). Log-probs come
from the decoder's hidden states through the chunked
:func:`lorafuse.ops.token_logprobs.token_logprobs` (no (tokens, vocab) logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.train.logprobs import head_and_decoder, sequence_logps
from lorafuse.train.preference import PairObjective, collate_pairs

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
AVERAGED = ("ipo", "simpo")  # loss types on token-averaged log-probs (TRL's average_log_prob)
# metric sums per step, in this order (all ranks' sums are added, then divided by the pairs)
SUMS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
        "logps/rejected", "nll_loss")  # fmt: skip


def cpo_loss(chosen, rejected, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5):  # fmt: skip
    """Per-pair loss (B,) and rewards ``β · log π`` (B,) of both responses.

    ``chosen`` / ``rejected`` (B,) are the policy's log-probs, token-averaged for ``ipo`` and
    ``simpo`` (:data:`AVERAGED`) and summed otherwise."""
    logits = chosen - rejected
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            logits = logits - simpo_gamma / beta
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * logits)
        if label_smoothing:
            losses = losses - label_smoothing * F.logsigmoid(-beta * logits)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"cpo_loss: loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


class CPOObjective(PairObjective):
    """CPO / SimPO for the engine: normalisers, per-micro-batch loss, metrics."""

    def __init__(self, beta: float, loss_type: str, cpo_alpha: float, simpo_gamma: float,
                 label_smoothing: float, pad_id: int, device) -> None:  # fmt: skip
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"CPOObjective: loss_type {loss_type!r} is not one of {LOSS_TYPES}")
        self.beta, self.loss_type, self.cpo_alpha = beta, loss_type, cpo_alpha
        self.simpo_gamma, self.label_smoothing = simpo_gamma, label_smoothing
        self.pad_id, self.device = pad_id, device

    @classmethod
    def from_config(cls, cfg, pad_id: int, device) -> CPOObjective:
        return cls(cfg.beta, cfg.loss_type, cfg.cpo_alpha, cfg.simpo_gamma, cfg.label_smoothing,
                   pad_id, device)  # fmt: skip

    def check(self, model) -> None:
        head_and_decoder(model)

    def loss(self, model, pairs, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, metric sums)`` of one micro-batch under the global ``counts``."""
        batch = collate_pairs(pairs, self.pad_id, self.device)
        B = len(pairs)
        weight = torch.tensor([float(p.n_examples) for p in pairs], device=self.device)  # (B,)
        n_tok = (F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:] != IGNORE_INDEX).sum(1)
        summed = sequence_logps(model, batch)  # (2B,) summed over each response
        logps = summed / n_tok.float().clamp(min=1) if self.loss_type in AVERAGED else summed
        chosen, rejected = logps[:B], logps[B:]
        losses, r_c, r_r = cpo_loss(
            chosen, rejected, beta=self.beta, loss_type=self.loss_type,
            label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma,
        )  # fmt: skip
        loss = (losses * weight).sum() / counts[0]
        nll = torch.zeros((), device=self.device)
        if self.cpo_alpha:
            # the chosen response tokens' NLL, per token of the global batch
            nll = -(summed[:B] * weight).sum() / counts[1].clamp(min=1)
            loss = loss + self.cpo_alpha * nll
        sums = torch.stack([
            (r_c * weight).sum(), (r_r * weight).sum(), ((r_c > r_r).float() * weight).sum(),
            (chosen.detach() * weight).sum(), (rejected.detach() * weight).sum(),
            nll.detach() * counts[0],  # per-pair-normalised in metrics()
        ])  # fmt: skip
        return loss, sums

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Global metric sums (all micro-batches, all ranks) -> per-pair means for the log."""
        n = max(float(counts[0]), 1.0)
        out = {k: float(v) / n for k, v in zip(SUMS, sums.tolist())}
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        if not self.cpo_alpha:
            del out["nll_loss"]
        return out
