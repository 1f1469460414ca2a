"""The running sequences of one adapter as one left-padded KV cache, stepped together.

Layout: every layer's keys and values are ``(B, H, L, D)``, each row's real tokens right-aligned
(left padding), with a ``(B, L)`` mask of 1 = real token. A sequence is prefilled alone (the same
forward as serving it alone) and then joins: the shorter side is padded on the left and the rows
concatenated. A decoding step feeds one token per row with the mask and each row's own position
(its count of real tokens), so RoPE sees the positions the sequence would have alone and padding
is never attended to. A row that leaves is dropped and leading columns that are padding in every
remaining row are cut, so the cache never grows past its longest sequence.

The hybrids' linear-attention layers (transformers' ``LinearAttentionLayer``: Gated DeltaNet, short
conv, Mamba2) hold per-row conv and recurrent states, not per-token tensors: their rows join and
leave with no padding, and their token count follows the batch's width (what the model reads for
positions when it is given none).

One sequence with no padding is stepped exactly as :func:`lorafuse.generation.stream_generate`
steps it (no mask, no positions: the model's own defaults, which a vision-language model's
M-RoPE needs). A model whose cache holds other layers (sliding-window ones) is not batchable:
:func:`batchable` says so and the scheduler keeps it to one sequence.
"""

from __future__ import annotations

import copy

import torch

from lorafuse.generation import CACHE_KW


def _kinds():
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    return DynamicLayer, LinearAttentionLayer


def batchable(cache) -> bool:
    """Whether ``cache`` (a model output's) can be padded and concatenated row-wise here."""
    from transformers import DynamicCache

    layers = getattr(cache, "layers", None)
    return type(cache) is DynamicCache and bool(layers) and all(type(x) in _kinds() for x in layers)


def _states(layer, fn) -> object:
    """A copy of a linear-attention ``layer`` whose every state ``t`` (``name`` "conv_states" or
    "recurrent_states", index ``i``) is ``fn(name, i, t)``."""
    new = copy.copy(layer)
    for name in ("conv_states", "recurrent_states"):
        setattr(new, name, {i: None if t is None else fn(name, i, t)
                            for i, t in getattr(layer, name).items()})  # fmt: skip
    for name in ("is_conv_states_initialized", "is_recurrent_states_initialized",
                 "has_previous_state", "conv_kernel_size"):  # fmt: skip
        setattr(new, name, dict(getattr(layer, name)))
    return new


def _cache_of(layers: list, width: int):
    """A DynamicCache of ``layers``: (keys, values) tensors or linear-attention layers, whose
    token count becomes ``width``."""
    from transformers import DynamicCache

    dynamic, _ = _kinds()
    cache = DynamicCache()
    for part in layers:
        if isinstance(part, tuple):
            layer = dynamic()
            layer.update(*part)  # an empty layer takes the tensors as they are
        else:
            layer = part
            layer.cumulative_length_linear = torch.tensor(width, device=layer.device)
        cache.layers.append(layer)
    return cache


def _parts(cache) -> list:
    dynamic, _ = _kinds()
    return [(x.keys, x.values) if type(x) is dynamic else x for x in cache.layers]


def _pad_left(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class PaddedBatch:
    """Rows of one KV cache. ``rows[i]`` is the caller's object for row i (its sequence)."""

    def __init__(self) -> None:
        self.cache = None
        self.mask: torch.Tensor | None = None  # (B, L) long, 1 = real token; None = no padding
        self.lengths: list[int] = []  # real tokens of each row in the cache
        self.rows: list = []

    def __len__(self) -> int:
        return len(self.rows)

    def width(self) -> int:
        return max(self.lengths, default=0) if self.mask is None else self.mask.shape[1]

    def join(self, row, cache, length: int) -> None:
        """Add a sequence prefilled alone: ``cache`` holds its ``length`` prompt tokens."""
        if not self.rows:
            self.cache, self.mask, self.lengths, self.rows = cache, None, [length], [row]
            return
        width = max(self.width(), length)
        old = self._mask()
        new_mask = torch.ones(1, length, dtype=torch.long, device=old.device)
        self.mask = torch.cat(
            [_pad_left(old, width - old.shape[1], 1), _pad_left(new_mask, width - length, 1)]
        )
        self.cache = _cache_of(
            [
                (
                    torch.cat([_pad_left(a[0], width - a[0].shape[2], 2), _pad_left(b[0], width - length, 2)]),
                    torch.cat([_pad_left(a[1], width - a[1].shape[2], 2), _pad_left(b[1], width - length, 2)]),
                )
                if isinstance(a, tuple)
                else _states(a, lambda name, i, t, b=b: torch.cat([t, getattr(b, name)[i]]))
                for a, b in zip(_parts(self.cache), _parts(cache))
            ], width,
        )  # fmt: skip
        self.lengths.append(length)
        self.rows.append(row)

    def drop(self, gone: set[int]) -> None:
        """Remove the rows at indices ``gone``; cut the columns that are now padding everywhere."""
        if not gone:
            return
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self.cache, self.mask = None, None
            return
        mask = self._mask()[keep]
        start = int(mask.any(0).nonzero()[0])  # first column some row still uses
        index = torch.tensor(keep)

        def rows(t):  # (B, ...) -> the kept rows
            return t.index_select(0, index.to(t.device))

        self.cache = _cache_of(
            [(rows(p[0])[:, :, start:], rows(p[1])[:, :, start:]) if isinstance(p, tuple)
             else _states(p, lambda name, i, t: rows(t)) for p in _parts(self.cache)],
            mask.shape[1] - start,
        )  # fmt: skip
        mask = mask[:, start:]
        self.mask = None if bool(mask.all()) else mask

    def _mask(self) -> torch.Tensor:
        if self.mask is not None:
            return self.mask
        return torch.ones(len(self.rows), self.width(), dtype=torch.long)

    def step(self, model, tokens: list[int]) -> torch.Tensor:
        """One decoding step: ``tokens[i]`` is row i's next input token. Returns the next
        position's raw logits, (B, V) fp32 on the CPU."""
        device = next(model.parameters()).device
        ids = torch.tensor(tokens, device=device).view(-1, 1)  # (B, 1)
        kwargs = {}
        if len(self.rows) > 1:  # positions per row; the mask (with this step's column) if padded
            kwargs["position_ids"] = torch.tensor(self.lengths, device=device).view(-1, 1)
            if self.mask is not None:
                ones = self.mask.new_ones(len(self.rows), 1)
                self.mask = torch.cat([self.mask, ones], 1)  # (B, L + 1)
                kwargs["attention_mask"] = self.mask.to(device)
        out = model(
            input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_KW: self.cache}, **kwargs
        )
        self.cache = getattr(out, CACHE_KW)
        self.lengths = [n + 1 for n in self.lengths]
        return out.logits[:, -1].float().cpu()
