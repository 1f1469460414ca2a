"""Causal depthwise convolution along the sequence (the short convolutions of Qwen3.5 /
Qwen3-Next's Gated DeltaNet, LFM2's conv layers and Mamba2), per packed example.

``y[:, c, t] = act(bias[c] + sum_j weight[c, j] * x[:, c, t - K + 1 + j])``, where positions before
an example's start read its ``initial_state`` (the K - 1 inputs before it, decoding's conv cache)
or zeros. Shapes: x (B, D, T) channels first, as transformers' conv modules see it; weight (D, K)
(``conv1d.weight[:, 0]``); bias (D,) or None; activation None or "silu". Output (B, D, T) in x's
dtype, computed in weight's dtype as transformers' ``causal_conv1d_fn`` does.

Examples: without ``cu_seqlens`` each batch row is one sequence (N = B); with ``cu_seqlens`` (int64
(N+1,), cumulative example boundaries over one row's T tokens, B = 1) the window restarts at every
boundary. ``initial_state`` / the final state: (N, D, K - 1), the last K - 1 inputs of each
example (zeros in front where an example is shorter), what the next decoding step needs.

:func:`causal_conv1d_reference` is plain autograd (``F.conv1d`` per example), the test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = (None, "silu")


def _examples(t: int, batch: int, cu_seqlens: Tensor | None):
    if cu_seqlens is None:
        return [(b, 0, t) for b in range(batch)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def causal_conv1d_reference(
    x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
    cu_seqlens=None,
):  # fmt: skip
    """``(y (B, D, T), final_state (N, D, K-1) or None)``, one ``F.conv1d`` per example."""
    _check(x, weight, bias, activation, initial_state, cu_seqlens)
    b, d, t = x.shape
    k = weight.shape[1]
    y = torch.empty(b, d, t, dtype=weight.dtype, device=x.device)
    finals = []
    for n, (row, s, e) in enumerate(_examples(t, b, cu_seqlens)):
        if initial_state is None:
            head = x.new_zeros(d, k - 1, dtype=weight.dtype)
        else:
            head = initial_state[n].to(weight.dtype)
        seq = torch.cat([head, x[row, :, s:e].to(weight.dtype)], dim=-1)  # (D, K-1+T_n)
        out = F.conv1d(seq[None], weight[:, None, :], bias, groups=d)[0]  # (D, T_n)
        y[row, :, s:e] = F.silu(out) if activation == "silu" else out
        finals.append(seq[:, seq.shape[-1] - (k - 1) :])
    final = torch.stack(finals).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), final


def _check(x, weight, bias, activation, initial_state, cu_seqlens):
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"causal_conv1d: x {tuple(x.shape)} must be (B, D, T) and weight {tuple(weight.shape)}"
            " (D, K)"
        )
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"causal_conv1d: bias {tuple(bias.shape)} must be (D,) = ({x.shape[1]},)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {ACTIVATIONS}")
    n = x.shape[0]
    if cu_seqlens is not None:
        cu, t = cu_seqlens, x.shape[2]
        if x.shape[0] != 1 or cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != t:
            raise ValueError(
                f"causal_conv1d: cu_seqlens must be (N+1,) from 0 to T={t} over one row (B=1), "
                f"got B={x.shape[0]} and {cu.tolist() if cu.numel() < 20 else tuple(cu.shape)}"
            )
        if (cu[1:] < cu[:-1]).any():
            raise ValueError("causal_conv1d: cu_seqlens must not decrease")
        n = cu.numel() - 1
    want = (n, x.shape[1], weight.shape[1] - 1)
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(
            f"causal_conv1d: initial_state {tuple(initial_state.shape)} must be (N, D, K-1) = {want}"
        )


def causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, activation: str | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The op's entry point (see the module docstring for shapes and ``cu_seqlens``)."""
    return causal_conv1d_reference(
        x, weight, bias, activation, initial_state, output_final_state, cu_seqlens
    )
