"""Rows (one or several examples) and batches of rows.

Packing puts several short examples in one row of at most ``max_seq_length`` tokens, so no compute
is spent on padding. Examples stay isolated: ``position_ids`` restart at 0 for every example, and
with no ``attention_mask`` transformers (>= 4.56; ``masking_utils.find_packed_sequence_indices``)
reads the restarts as sequence boundaries and builds a block-diagonal causal mask for the sdpa and
eager attention paths; token mixers that carry state along the sequence (Gated DeltaNet, short
convolutions, Mamba2) restart it at the same boundaries (:mod:`lorafuse.patching.mixers`), and
models where either cannot hold train unpacked (:func:`lorafuse.models.capabilities.packing_supported`).
Each example's first label is -100 (see :mod:`lorafuse.data.masking`), so no token learns to predict
the next example either. ``tests/patching/test_packing_isolation.py`` checks, for every family, that
logits of a packed row equal those of each example run alone.

Unpacked rows are one example each; batches of them are right-padded with an ``attention_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorafuse.data.masking import IGNORE_INDEX, Encoded


@dataclass
class Row:
    """One row of a batch: concatenated examples and where each one starts."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    n_examples: int

    @property
    def n_targets(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


def single_rows(examples: list[Encoded]) -> list[Row]:
    """One row per example (no packing)."""
    return [Row(e.input_ids, e.labels, list(range(len(e.input_ids))), 1) for e in examples]


def pack(examples: list[Encoded], max_seq_length: int) -> list[Row]:
    """Greedy in-order packing: append examples to the current row while they fit.

    In order (not sorted by length) so that the data order, which the caller shuffled with its
    seed, is kept and the rows are reproducible. Examples are already <= max_seq_length.
    """
    rows: list[Row] = []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    count = 0
    for ex in examples:
        n = len(ex.input_ids)
        if n > max_seq_length:
            raise ValueError(f"example of {n} tokens exceeds max_seq_length={max_seq_length}")
        if ids and len(ids) + n > max_seq_length:
            rows.append(Row(ids, labels, pos, count))
            ids, labels, pos, count = [], [], [], 0
        ids.extend(ex.input_ids)
        labels.extend(ex.labels)
        pos.extend(range(n))
        count += 1
    if ids:
        rows.append(Row(ids, labels, pos, count))
    return rows


def collate(rows: list[Row], pad_id: int, packed: bool) -> dict[str, torch.Tensor]:
    """Batch rows into tensors of shape (B, T), T = longest row.

    Packed batches carry ``position_ids`` and no ``attention_mask`` (the mask is derived from the
    position restarts; padding continues as one more "example" with labels -100). Unpacked batches
    carry an ``attention_mask`` (1 = real token) and rely on right padding.
    """
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    pos = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        labels[i, :n] = torch.tensor(r.labels)
        pos[i, :n] = torch.tensor(r.position_ids)
        pos[i, n:] = torch.arange(
            width - n
        )  # padding: its own segment, never attended by real tokens
        mask[i, :n] = 1
    if packed:
        return {"input_ids": ids, "labels": labels, "position_ids": pos}
    if bool(mask.all()):  # no padding at all: let sdpa use its plain causal path
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
