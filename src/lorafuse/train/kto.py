"""KTO (Ethayarajh et al. 2024) on the fused engine, as TRL's ``KTOTrainer`` computes it.

An :class:`~lorafuse.train.objective.Objective` (``check``, ``tokens``, ``counts``, ``loss``,
``metrics``) like SFT, DPO and ORPO: the engine runs its step the same way. Per record (summed
completion log-probs, ``r = log π(y|x) - log π_ref(y|x)``):

* desirable:   ``λ_D (1 - σ(β (r - z)))``;  undesirable: ``λ_U (1 - σ(β (z - r)))``;
* ``z`` = the KL reference point, estimated per micro-batch as TRL does: the mismatched pairs
  ``(x_i, y_{i-1})`` (completions rotated by one), ``z = max(0, mean(log π - log π_ref))``,
  detached (no gradient flows through it).

The loss of a step is the sum over its records divided by the global record count: with one
micro-batch it is TRL's ``losses.nanmean()``. Since ``z`` is a per-micro-batch estimate (TRL's too:
per device batch), accumulation is not exactly one big batch unless z is 0 in both. The reference
is the model with the adapter disabled; log-probs come from the decoder's hidden states through
the chunked :func:`lorafuse.ops.token_logprobs.token_logprobs` (no logits tensor).
"""

from __future__ import annotations

import torch

from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.data.packing import Row, collate
from lorafuse.train.logprobs import head_and_decoder, peft_model, sequence_logps
from lorafuse.train.objective import Objective, ObjectiveError

# metric sums per step (all ranks' sums are added)
SUMS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl", "batches")


def kto_loss(logps, ref_logps, labels, kl, *, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0):  # fmt: skip
    """Per-record weighted KTO loss (B,) and rewards ``β r`` (B,); ``labels`` (B,) bool."""
    ratio = logps - ref_logps
    desirable = 1 - torch.sigmoid(beta * (ratio - kl))
    undesirable = 1 - torch.sigmoid(beta * (kl - ratio))
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses, beta * ratio.detach()


def kl_rows(rows):
    """TRL's mismatched pairs: prompt of row i with the completion of row i-1 (i-1 cycles)."""
    out = []
    for i, row in enumerate(rows):
        prev = rows[i - 1]
        ids = row.enc.input_ids[: row.prompt_len] + prev.enc.input_ids[prev.prompt_len :]
        labels = [IGNORE_INDEX] * row.prompt_len + prev.enc.labels[prev.prompt_len :]
        out.append((ids, labels))
    return out


def _batch(seqs, pad_id: int, device) -> dict[str, torch.Tensor]:
    rows = [Row(ids, labels, list(range(len(ids))), 1) for ids, labels in seqs]
    return {k: v.to(device) for k, v in collate(rows, pad_id, packed=False).items()}


class KTOError(ObjectiveError):
    """The model cannot be trained with KTO (the message says why)."""


class KTOObjective(Objective):
    """KTO for the engine: normalisers, per-micro-batch loss, metrics."""

    def __init__(self, beta: float, desirable_weight: float, undesirable_weight: float,
                 pad_id: int, device, max_len: int | None = None) -> None:  # fmt: skip
        self.beta, self.pad_id, self.device, self.max_len = beta, pad_id, device, max_len
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    @classmethod
    def from_config(cls, cfg, pad_id: int, device) -> KTOObjective:
        return cls(cfg.beta, cfg.desirable_weight, cfg.undesirable_weight, pad_id, device,
                   cfg.max_seq_length)  # fmt: skip

    def check(self, model) -> None:
        head_and_decoder(model)
        if not hasattr(peft_model(model), "disable_adapter"):
            raise KTOError("kto needs a PEFT model: its reference is the adapter disabled")

    def tokens(self, row) -> int:
        return row.n_tokens

    def counts(self, rows) -> torch.Tensor:
        """This rank's ``[records, desirable, undesirable]``."""
        real = [r for r in rows if r.n_examples]
        n_d = sum(1 for r in real if r.label)
        return torch.tensor([float(len(real)), float(n_d), float(len(real) - n_d)],
                            device=self.device)  # fmt: skip

    def loss(self, model, rows, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, metric sums)`` of one micro-batch; summed over micro-batches and ranks,
        ``loss`` is the mean loss of the global batch."""
        real = [r for r in rows if r.n_examples]  # padding rows: no KL pair, zero weight
        main = _batch([(r.enc.input_ids, r.enc.labels) for r in rows], self.pad_id, self.device)
        mism = kl_rows(real)
        if self.max_len:
            mism = [(i[: self.max_len], lab[: self.max_len]) for i, lab in mism]
        peft = peft_model(model)  # no DDP wrapper for the no-grad passes
        kl = torch.zeros((), device=self.device)
        with torch.no_grad():
            with peft.disable_adapter():
                ref = sequence_logps(peft, main)
                if mism:
                    kl_batch = _batch(mism, self.pad_id, self.device)
                    kl = kl - sequence_logps(peft, kl_batch).mean()
            if mism:
                kl = (kl + sequence_logps(peft, kl_batch).mean()).clamp(min=0)
        logps = sequence_logps(model, main)  # (B,) the only pass with a gradient
        labels = torch.tensor([r.label for r in rows], device=self.device)
        weight = torch.tensor([float(r.n_examples) for r in rows], device=self.device)
        losses, rewards = kto_loss(logps, ref, labels, kl, beta=self.beta,
                                   desirable_weight=self.desirable_weight,
                                   undesirable_weight=self.undesirable_weight)  # fmt: skip
        loss = (losses * weight).sum() / counts[0]
        d, u = weight * labels, weight * ~labels
        lp = logps.detach()
        sums = torch.stack([(rewards * d).sum(), (rewards * u).sum(), (lp * d).sum(),
                            (lp * u).sum(), kl, torch.ones((), device=self.device)])  # fmt: skip
        return loss, sums

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Global sums -> TRL's per-record means; ``kl`` the mean over micro-batches."""
        s = dict(zip(SUMS, sums.tolist()))
        n_d, n_u = float(counts[1]), float(counts[2])
        out = {"kl": s["kl"] / max(s["batches"], 1.0)}
        if n_d:
            out["rewards/chosen"] = s["rewards/chosen"] / n_d
            out["logps/chosen"] = s["logps/chosen"] / n_d
        if n_u:
            out["rewards/rejected"] = s["rewards/rejected"] / n_u
            out["logps/rejected"] = s["logps/rejected"] / n_u
        if n_d and n_u:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out
