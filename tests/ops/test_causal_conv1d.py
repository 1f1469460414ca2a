"""Causal depthwise conv1d's reference against transformers' own function, per packed example,
and continued from a decoding state."""

import pytest
import torch

from lorafuse.ops.causal_conv1d import causal_conv1d


def _inputs(b=2, d=12, t=37, k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, d, t, generator=gen), torch.randn(d, k, generator=gen),
            torch.randn(d, generator=gen))  # fmt: skip


@pytest.mark.parametrize("activation", [None, "silu"])
def test_equals_transformers_causal_conv1d_fn(activation):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, w, b = _inputs()
    y, _ = causal_conv1d(x, w, b, activation=activation)
    torch.testing.assert_close(y, causal_conv1d_fn(x, w, b, activation=activation))


def test_packed_examples_restart_the_window():
    x, w, b = _inputs(b=1)
    cu = torch.tensor([0, 10, 11, 37])
    y, final = causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu, output_final_state=True)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone, f = causal_conv1d(x[:, :, s:e], w, b, activation="silu", output_final_state=True)
        assert torch.equal(y[:, :, s:e], alone)
        assert torch.equal(final[i], f[0])


def test_decoding_state_continues_the_sequence():
    x, w, b = _inputs(b=1)
    y_all, _ = causal_conv1d(x, w, b, activation="silu")
    y1, state = causal_conv1d(x[:, :, :20], w, b, activation="silu", output_final_state=True)
    y2, _ = causal_conv1d(x[:, :, 20:], w, b, activation="silu", initial_state=state)
    torch.testing.assert_close(torch.cat([y1, y2], -1), y_all)
