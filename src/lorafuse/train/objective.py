"""What the engine asks of a training objective, and SFT's token loss as one.

The engine's step and eval are the same for every method (``sft``, ``dpo``, ``orpo``, ``kto``;
``grpo`` brings its own step, :mod:`lorafuse.train.grpo_trainer`): for the rows of a global batch
it sums :meth:`Objective.counts` over all micro-batches and ranks (the normalisers), runs
:meth:`Objective.loss` on each micro-batch and backpropagates it, and turns the summed metric
sums into log entries with :meth:`Objective.metrics`. Because every micro-batch divides by the
*global* normalisers, k accumulated micro-batches on W ranks give the gradient of one big batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Objective:
    """The interface; :class:`SFTObjective`, :class:`~lorafuse.train.preference.PreferenceObjective`,
    :class:`~lorafuse.train.kto.KTOObjective` and :class:`~lorafuse.train.grpo.GRPOObjective`
    implement it."""

    def check(self, model) -> None:
        """Fail before training when ``model`` cannot run this objective."""

    def tokens(self, row) -> int:
        """Tokens a real row puts through the model (for tokens/s)."""
        raise NotImplementedError

    def counts(self, rows) -> torch.Tensor:
        """This rank's normalisers of ``rows`` (the engine sums them over ranks)."""
        raise NotImplementedError

    def loss(self, model, rows, counts) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, metric sums)`` of one micro-batch under the global ``counts``."""
        raise NotImplementedError

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Global metric sums -> the step's log entries."""
        return {}

    def eval_normalisers(self, counts: torch.Tensor):
        """``(counts for each eval micro-batch, divisor of the summed eval loss)``: by default
        the eval rows are one global batch, so the summed loss is already their mean."""
        return counts, 1.0


class SFTObjective(Objective):
    """Supervised fine-tuning: the model's own mean token loss over the target tokens.

    ``forward(rows, n_items)`` is the trainer's collate and model call (packed, padded or vision
    batches are the trainer's business) returning ``sum(token losses) / n_items``, transformers'
    ``num_items_in_batch`` loss.
    """

    def __init__(self, forward: Callable[[list, object], torch.Tensor], device) -> None:
        self.forward, self.device = forward, device

    def tokens(self, row) -> int:
        return len(row.input_ids)

    def counts(self, rows) -> torch.Tensor:
        """This rank's target tokens (padding rows have none)."""
        return torch.tensor(float(sum(r.n_targets for r in rows)), device=self.device)

    def loss(self, model, rows, counts) -> tuple[torch.Tensor, torch.Tensor]:
        # ``model`` is the one ``forward`` runs (the trainer's wrapped model)
        return self.forward(rows, counts), torch.zeros((), device=self.device)

    def eval_normalisers(self, counts: torch.Tensor):
        # each micro-batch's token-loss sum (n_items = 1), divided once by all target tokens
        return 1.0, float(counts)
