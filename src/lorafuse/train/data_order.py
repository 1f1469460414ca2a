"""The order rows are trained in: seeded epoch permutations, the resumable position in them, and
how one optimizer step's rows split into micro-batches per rank (padded with zero-weight rows so
every rank runs the same passes)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lorafuse.data.packing import Row
from lorafuse.train import distributed as dist


@dataclass
class Position:
    """Where the next optimizer step starts: epoch and row offset into that epoch's order."""

    epoch: int = 0
    offset: int = 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def epoch_order(n_rows: int, seed: int, epoch: int) -> list[int]:
    """The seeded row permutation of ``epoch`` (independent of the global RNG, so resumable)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_rows, generator=g).tolist()


def zero_row(like: Row) -> Row:
    """A padding row that contributes nothing: same tokens, no targets."""
    return Row(like.input_ids, [-100] * len(like.labels), like.position_ids, 0)


def micro_batches(rows: list[int], data: list[Row], micro: int, ctx) -> list[list[Row]]:
    """Split global rows into micro-batches of ``micro`` rows; keep this rank's share (+ padding)."""
    out = []
    for start in range(0, len(rows), micro):
        chunk = rows[start : start + micro]
        mine = [data[chunk[i]] for i in dist.shard_rows(len(chunk), ctx)]
        pad = dist.rows_per_rank(len(chunk), ctx) - len(mine)
        like = data[chunk[0]]
        zero = like.zeroed() if hasattr(like, "zeroed") else zero_row(like)
        out.append(mine + [zero] * pad)
    return out
