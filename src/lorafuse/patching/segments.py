"""Where each sequence of a batch starts: the boundaries every stateful token mixer (Gated
DeltaNet, short convolutions, Mamba2) restarts its state at.

:func:`find` reads them, once per forward, from what the decoder model is given:

* position ids: a packed row's positions restart for every example (:mod:`lorafuse.data.packing`),
  so any step that is not +1 starts a new example (transformers' ``find_packed_sequence_indices``
  reads them the same way for the attention mask);
* a 2D attention mask: every change between padding and real tokens starts a new example, so
  padding (left or right) forms examples of its own and never feeds a real token's state.

:class:`Segments` describes the batch flattened to one row of B * T tokens, in the ops' varlen
convention (``cu_seqlens``, flash-linear-attention's), plus which example of each row continues a
cached state (decoding) and which one leaves its state in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segments:
    """The examples of a (B, T) batch, flattened to one row of B * T tokens."""

    cu_seqlens: Tensor  # (N+1,) int64 boundaries over the B * T tokens
    row_first: Tensor  # (B,) index of each row's first example (it continues the row's cache)
    row_last: Tensor  # (B,) index of each row's last example holding a real token (it is cached)

    @property
    def count(self) -> int:
        return self.cu_seqlens.numel() - 1

    def initial(self, state: Tensor | None) -> Tensor | None:
        """Per-row states (B, ...) (a cache's) -> initial states of every example (N, ...): each
        row's first example continues its row's state, the others start from zeros."""
        if state is None:
            return None
        out = state.new_zeros(self.count, *state.shape[1:])
        return out.index_copy(0, self.row_first, state)

    def final(self, states: Tensor | None) -> Tensor | None:
        """Final states of every example (N, ...) -> what each row leaves in its cache (B, ...)."""
        return None if states is None else states.index_select(0, self.row_last)


def text_positions(position_ids: Tensor | None) -> Tensor | None:
    """The (B, T) text positions: Qwen3.5's (4, B, T) ids carry them in row 0; multimodal rotary
    ids alone (3, B, T) do not say where sequences start (None)."""
    if position_ids is None or position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return None


def find(position_ids: Tensor | None, attention_mask: Tensor | None, batch: int,
         length: int) -> Segments | None:  # fmt: skip
    """The examples of a (``batch``, ``length``) forward, or None when every row is one sequence
    with no padding (the ops then run row by row). ``attention_mask``: (B, >= T) 2D, its last T
    columns are this forward's (a cached prefix comes first); any other form is ignored."""
    positions = text_positions(position_ids)
    starts = torch.zeros(batch, length, dtype=torch.bool)
    if positions is not None and positions.shape[-1] == length and length > 1:
        positions = positions.expand(batch, -1).cpu()
        starts[:, 1:] |= positions[:, 1:] != positions[:, :-1] + 1
    real = None
    if attention_mask is not None and attention_mask.dim() == 2 and length > 1:
        mask = attention_mask[:, -length:].bool().cpu()
        if not bool(mask.all()):
            starts[:, 1:] |= mask[:, 1:] != mask[:, :-1]
            real = mask
    if not bool(starts[:, 1:].any()) and real is None:
        return None
    starts[:, 0] = True
    flat = starts.flatten().nonzero().squeeze(1)  # (N,) first token of every example
    per_row = starts.sum(1)  # (B,)
    row_first = per_row.cumsum(0) - per_row
    index = torch.arange(flat.numel())
    is_real = real.flatten()[flat] if real is not None else torch.ones_like(flat, dtype=torch.bool)
    last = torch.full((batch,), -1).scatter_reduce(
        0, flat // length, torch.where(is_real, index, -1), "amax"
    )  # (B,) a row of padding only keeps its last example
    row_last = torch.where(last < 0, row_first + per_row - 1, last)
    device = attention_mask.device if attention_mask is not None else position_ids.device
    cu = torch.cat([flat, flat.new_tensor([batch * length])])
    return Segments(cu.to(device), row_first.to(device), row_last.to(device))
