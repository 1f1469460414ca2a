"""The decode-time states of a stateful token mixer, kept in transformers' own cache.

transformers 5.25's ``DynamicCache(config=...)`` gives every ``linear_attention`` / ``conv`` layer a
``LinearAttentionLayer``: a conv state (B, D, K) (the last K conv inputs) and a recurrent state
per row, plus the token count that ``get_seq_length`` (and so the next positions) reads.
:class:`MixerCache` reads and writes them through the cache's public methods, in the order and
with the counts transformers' own mixers use, so ``generate``, ``stream_generate``, serve and the
GRPO rollouts step a patched model exactly as a stock one. Our ops keep K - 1 conv inputs (all the
next step reads); the cache's extra oldest column is written as zeros.

Speculative decoding's past recording (``cache.activate_past_recording``) grows the conv states
instead; the patched mixers refuse it with one clear error.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lorafuse.errors import LorafuseError


class MixerCache:
    """One mixer layer's view of ``cache`` (None: no cache, nothing kept)."""

    def __init__(self, cache, layer_idx: int) -> None:
        self.cache, self.idx = cache, layer_idx
        self.conv: Tensor | None = None  # (B, D, K - 1) the previous conv inputs, or None
        self.recurrent: Tensor | None = None  # the previous recurrent state, or None
        if cache is None:
            return
        if cache.is_recording_past(layer_idx):
            raise LorafuseError(
                "assisted / speculative decoding (a cache recording past states) is not supported "
                "by lorafuse's hybrid token mixers; decode without an assistant model"
            )
        conv = cache.get_conv_state(layer_idx)  # None until the layer's first forward
        self.conv = None if conv is None else conv[..., 1:]
        self.recurrent = cache.get_recurrent_state(layer_idx)

    @property
    def keeps(self) -> bool:
        """Whether the forward must return its final states (a cache is being filled)."""
        return self.cache is not None

    def store(self, conv_input: Tensor, conv_final: Tensor, recurrent: Tensor | None = None):
        """After a forward over ``conv_input`` (B, D, T): keep ``conv_final`` (B, D, K - 1) and
        ``recurrent`` (B, ...) as the layer's states; the token count grows by T."""
        if self.cache is None:
            return
        kernel = conv_final.shape[-1] + 1
        if self.conv is None or conv_input.shape[-1] > 1:
            # Initialises the layer (prefill) or continues it; counts T tokens.
            self.cache.update_conv_state(conv_input, self.idx, conv_kernel_size=kernel)
        else:
            self.cache.increase_count(self.idx, 0)  # one token, as transformers' decoding step
        self.cache.get_conv_state(self.idx).copy_(F.pad(conv_final, (1, 0)))
        if recurrent is not None:
            self.cache.update_recurrent_state(recurrent, self.idx)


def repeat_rows(cache, repeats: int) -> None:
    """``cache.batch_repeat_interleave(repeats)`` for caches holding linear-attention layers too:
    transformers 5.25's ``LinearAttentionLayer`` has no such method (and the hybrid layers repeat
    their keys and values only), so the conv and recurrent states are repeated here."""
    for layer in cache.layers:
        if hasattr(layer, "batch_repeat_interleave"):
            layer.batch_repeat_interleave(repeats)  # keys and values (attention layers)
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            for i, s in states.items():
                if s is not None:
                    states[i] = s.repeat_interleave(repeats, dim=0)
