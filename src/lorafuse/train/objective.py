"""What the engine asks of a training objective, and SFT's token loss as one.

The engine's step and eval are the same for every method (a method with its own step, like GRPO,
brings its trainer class: :mod:`lorafuse.train.recipes`): for the rows of a global batch
it sums :meth:`Objective.counts` over all micro-batches and ranks (the normalisers), runs
:meth:`Objective.loss` on each micro-batch and backpropagates it, and turns the summed metric
sums into log entries with :meth:`Objective.metrics`. Because every micro-batch divides by the
*global* normalisers, k accumulated micro-batches on W ranks give the gradient of one big batch.
"""

from __future__ import annotations

import torch

from lorafuse.data.packing import collate
from lorafuse.data.vision_rows import collate as collate_vision
from lorafuse.errors import LorafuseError


class ObjectiveError(LorafuseError, RuntimeError):
    """The model cannot be trained with this objective (the message says why); each objective
    module has its own subclass."""


class Objective:
    """The interface; :class:`SFTObjective`, :class:`~lorafuse.train.preference.PreferenceObjective`,
    :class:`~lorafuse.train.kto.KTOObjective` and :class:`~lorafuse.train.grpo.GRPOObjective`
    implement it."""

    # the input shape of the last micro-batch :meth:`loss` ran, where the objective records it
    # (named when a step runs out of memory)
    batch_shape: tuple[int, ...] | None = None

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

    A micro-batch is collated here (packed, padded, or a vision-language model's rows) and its
    loss is ``sum(token losses) / counts``, transformers' ``num_items_in_batch`` loss.
    """

    def __init__(self, pad_id: int, packed: bool, vision: bool, device) -> None:
        self.pad_id, self.packed, self.vision, self.device = pad_id, packed, vision, device

    def tokens(self, row) -> int:
        return len(row.input_ids)

    def counts(self, rows) -> torch.Tensor:
        """This rank's target tokens (padding rows have none)."""
        return torch.tensor(float(sum(r.n_targets for r in rows)), device=self.device)

    def collate(self, rows) -> dict[str, torch.Tensor]:
        """The micro-batch's model inputs on the device."""
        if self.vision:
            batch = collate_vision([r.tensors for r in rows], self.pad_id)
        else:
            batch = collate(rows, self.pad_id, self.packed)
        return {k: v.to(self.device) for k, v in batch.items()}

    def loss(self, model, rows, counts) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.collate(rows)
        self.batch_shape = tuple(batch["input_ids"].shape)
        loss = model(**batch, num_items_in_batch=counts, use_cache=False).loss
        return loss, torch.zeros((), device=self.device)

    def eval_normalisers(self, counts: torch.Tensor):
        # each micro-batch's token-loss sum (n_items = 1), divided once by all target tokens
        return 1.0, float(counts)
