"""The running sequences of every adapter as one decode-engine batch, stepped together.

Where the decode engine runs the served model (:func:`lorafuse.decode.engine_for`), serve's
worker keeps all running sequences here instead of one :class:`~lorafuse.serve.batch.PaddedBatch`
per adapter: each sequence has its own KV block and adapter index, so one engine step feeds
every running sequence whatever its adapter, and a sequence joins or leaves between steps
without touching the others' caches (no padding, no re-layout).
"""

from __future__ import annotations

import torch

from lorafuse.decode import DecodeEngine, Sequence


class EngineBatch:
    """Rows of one engine batch: ``rows[i]`` is the caller's object for row i, ``seqs[i]`` its
    engine sequence."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self.rows: list = []
        self.seqs: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, row, seq: Sequence) -> None:
        """Add a sequence whose prompt is prefilled."""
        self.rows.append(row)
        self.seqs.append(seq)

    def drop(self, gone: set[int]) -> None:
        """Remove the rows at indices ``gone`` and give their slots back."""
        if not gone:
            return
        for i in gone:
            self.engine.close(self.seqs[i])
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.seqs = [self.seqs[i] for i in keep]

    def step(self, tokens: list[int]) -> torch.Tensor:
        """One decoding step, ``tokens[i]`` row i's next input: raw logits (B, V) fp32."""
        return self.engine.step(self.seqs, tokens)
