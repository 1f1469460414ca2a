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
:class:`CausalConv1dFunction` has a hand-written backward (dx, dweight, dbias, dinitial_state);
all its backends compute in fp32 (fp64 for fp64 inputs, torch backend) with one rounding to the
output dtype. Saved for backward: x, weight, bias, initial_state and cu_seqlens as given; the
pre-activation is recomputed (K multiply-adds a value), never stored.

Backends (chosen in :mod:`lorafuse.backends`): ``torch`` (this file: the examples laid end to end
behind their states, one depthwise ``F.conv1d`` and its gradient convolutions), ``cpp``
(``csrc/causal_conv1d.cpp``: ``causal_conv1d_forward`` / ``causal_conv1d_backward``), ``triton``
(``triton/causal_conv1d.py``). Under ``torch.compile`` (end of this file):
``lorafuse::causal_conv1d`` and ``lorafuse::causal_conv1d_backward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import autocast, custom_ops

ACTIVATIONS = (None, "silu")

# ---- Policy: fp64 on torch --------------------------------------------------------------------
# The compiled kernels compute in fp32; fp64 inputs (the oracle's dtype) run torch. Without a
# gradient the backend's forward runs alone (decoding's one-token update included), saving nothing.


def _unsupported(x: Tensor, weight: Tensor) -> str | None:
    if torch.float64 in (x.dtype, weight.dtype):
        return "float64 inputs (the kernels compute in fp32)"
    return None


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
        # values only in eager: under torch.compile they would break the graph (the kernels check)
        values = not custom_ops.active()
        if (
            x.shape[0] != 1
            or cu.dim() != 1
            or cu.numel() < 2
            or (values and (cu[0] != 0 or cu[-1] != t))
        ):
            raise ValueError(
                f"causal_conv1d: cu_seqlens must be (N+1,) from 0 to T={t} over one row (B=1), "
                f"got B={x.shape[0]} and {cu.tolist() if cu.numel() < 20 else tuple(cu.shape)}"
            )
        if values and (cu[1:] < cu[:-1]).any():
            raise ValueError("causal_conv1d: cu_seqlens must not decrease")
        n = cu.numel() - 1
    want = (n, x.shape[1], weight.shape[1] - 1)
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(
            f"causal_conv1d: initial_state {tuple(initial_state.shape)} must be (N, D, K-1) = {want}"
        )


def _layout(x: Tensor, k: int, n: int, cu_seqlens: Tensor):
    """Packed examples' indices along the row's time axis. The source is ``[x | states]`` (T +
    N(K-1) columns, the N states one after another); ``ext`` puts each example behind its K - 1
    state columns; ``out`` picks each token's window among the valid convolution's outputs;
    ``final`` the last K - 1 columns of each example in ``ext``."""
    t, h = x.shape[2], k - 1
    cu = cu_seqlens.tolist()
    ext, out, final = [], [], []
    for i in range(n):
        s, e = cu[i], cu[i + 1]
        base = len(ext)
        ext += list(range(t + i * h, t + (i + 1) * h)) + list(range(s, e))
        out += list(range(base, base + e - s))
        final += list(range(base + e - s, base + e - s + h))
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=x.device)  # noqa: E731
    return as_tensor(ext), as_tensor(out), as_tensor(final)


def _extended(x, initial_state, k, n, cu_seqlens, dt):
    """``(ext (B', D, E) in dt, indices or None)``: each example behind its K - 1 state columns,
    one row per batch row (B' = B, E = T + K - 1) or, packed, one row of all (B' = 1)."""
    b, d, t = x.shape
    if initial_state is None:
        initial_state = x.new_zeros(n, d, k - 1)
    states = initial_state.to(dt)  # (N, D, K-1)
    if cu_seqlens is None:
        return torch.cat([states, x.to(dt)], -1), None
    states = states.permute(1, 0, 2).reshape(1, d, n * (k - 1))  # the N states side by side
    idx = _layout(x, k, n, cu_seqlens)
    return torch.cat([x.to(dt), states], -1).index_select(-1, idx[0]), idx


def _final(ext, idx, n, k):
    """Each example's last K - 1 inputs (N, D, K-1) from ``ext``."""
    if idx is None:
        return ext[..., ext.shape[-1] - (k - 1) :].contiguous()
    d = ext.shape[1]
    return ext[0].index_select(-1, idx[2]).view(d, n, k - 1).transpose(0, 1).contiguous()


def _torch_forward(x, weight, bias, activation, initial_state, cu_seqlens, n):
    """``(y (B, D, T) x.dtype, final (N, D, K-1) x.dtype)``; fp32 math (fp64 for fp64)."""
    d, k = weight.shape
    dt = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    ext, idx = _extended(x, initial_state, k, n, cu_seqlens, dt)
    bias_dt = None if bias is None else bias.to(dt)
    z = F.conv1d(ext, weight.to(dt)[:, None], bias_dt, groups=d)  # (B', D, E - K + 1)
    if idx is not None:
        z = z.index_select(-1, idx[1])
    y = F.silu(z) if activation == "silu" else z
    return y.to(x.dtype), _final(ext, idx, n, k).to(x.dtype)


def _torch_backward(dy, dfinal, x, weight, bias, activation, initial_state, cu_seqlens, n, needs):
    """``(dx, dweight, dbias, dinitial_state)`` in their inputs' dtypes, each None unless
    ``needs`` (4 bools) asks for it."""
    b, d, t = x.shape
    k = weight.shape[1]
    dt = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    ext, idx = _extended(x, initial_state, k, n, cu_seqlens, dt)
    w = weight.to(dt)[:, None]  # (D, 1, K)
    dz = dy.to(dt)
    if activation == "silu":  # the pre-activation, recomputed; d silu(z)/dz = s·(1 + z·(1 - s))
        z = F.conv1d(ext, w, None if bias is None else bias.to(dt), groups=d)
        z = z.index_select(-1, idx[1]) if idx is not None else z
        s = torch.sigmoid(z)
        dz = dz * s * (1.0 + z * (1.0 - s))
    if idx is not None:  # the valid outputs that are no token's: zero gradient
        dz = dz.new_zeros(1, d, ext.shape[-1] - k + 1).index_copy_(-1, idx[1], dz)
    need_ext = needs[0] or (needs[3] and initial_state is not None)
    dext, dw, _ = torch.ops.aten.convolution_backward(
        dz, ext, w, None, [1], [0], [1], False, [0], d, [need_ext, needs[1], False]
    )
    db = dz.sum((0, 2)).to(bias.dtype) if needs[2] and bias is not None else None
    dw = dw[:, 0].to(weight.dtype) if needs[1] else None
    dx = dh = None
    if need_ext:
        dx, dh = _ext_grads(dext, dfinal, idx, x, n, k)
        dx = dx.to(x.dtype) if needs[0] else None
        dh = dh.to(initial_state.dtype) if needs[3] and initial_state is not None else None
    return dx, dw, db, dh


def _ext_grads(dext, dfinal, idx, x, n, k):
    """``ext``'s gradient (and the final state's) back to ``(dx (B, D, T), dstates (N, D, K-1))``."""
    b, d, t = x.shape
    if idx is None:
        if dfinal is not None:
            dext[..., dext.shape[-1] - (k - 1) :] += dfinal
        return dext[..., k - 1 :], dext[..., : k - 1].contiguous()
    if dfinal is not None:
        dext[0].index_add_(-1, idx[2], dfinal.transpose(0, 1).reshape(d, n * (k - 1)))
    dsrc = dext.new_zeros(d, t + n * (k - 1)).index_add_(-1, idx[0], dext[0])
    dh = dsrc[:, t:].view(d, n, k - 1).transpose(0, 1).contiguous()
    return dsrc[None, :, :t], dh


def _implementation(backend: str):
    if backend == "torch":
        return _torch_forward, _torch_backward
    return backends.compiled("causal_conv1d", backend, "forward", "backward")


class CausalConv1dFunction(torch.autograd.Function):
    """The convolution with its hand-written backward: ``(y, final_state)``, every backend."""

    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, activation, cu_seqlens, n, backend):
        fwd, _ = _implementation(backend)
        y, final = fwd(x, weight, bias, activation, initial_state, cu_seqlens, n)
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.activation, ctx.n, ctx.backend = activation, n, backend
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        needs = tuple(ctx.needs_input_grad[:4])
        if not any(needs) or (dy is None and dfinal is None):
            return (None,) * 8
        x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
        dy = torch.zeros_like(x) if dy is None else dy
        _, bwd = _implementation(ctx.backend)
        with autocast.disabled(x.device):  # fp32 math whatever the caller's autocast state
            grads = bwd(dy, dfinal, x, weight, bias, ctx.activation, initial_state, cu_seqlens,
                        ctx.n, needs)  # fmt: skip
        return (*(d if need else None for d, need in zip(grads, needs)), None, None, None, None)


def causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, activation: str | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None, backend: str | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The op's entry point (see the module docstring for shapes and ``cu_seqlens``)."""
    _check_tensors(x, weight, bias, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.int64)
    _check(x, weight, bias, activation, initial_state, cu_seqlens)
    n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    chosen = backends.select(
        "causal_conv1d", x.device, backend, unsupported=_unsupported(x, weight)
    )
    ins = (x, weight, bias, initial_state)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ins)
    with autocast.disabled(x.device):  # fp32 math (weight's dtype upcast) under autocast too
        if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
            y, final = causal_conv1d_op(*ins, activation, cu_seqlens, n, chosen)
        elif grad:
            y, final = CausalConv1dFunction.apply(*ins, activation, cu_seqlens, n, chosen)
        else:
            y, final = _implementation(chosen)[0](
                *ins[:3], activation, initial_state, cu_seqlens, n
            )
    return y, (final if output_final_state else None)


def _check_tensors(x, weight, bias, initial_state, cu_seqlens):
    """dtypes and devices (the shapes: :func:`_check`)."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if t is None:
            continue
        if not t.is_floating_point():
            raise ValueError(f"causal_conv1d: {name} must be floating point, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"causal_conv1d: {name} on {t.device}, x on {x.device}")
    if cu_seqlens is not None and cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"causal_conv1d: cu_seqlens must be int32/int64, got {cu_seqlens.dtype}")


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


def _channels_adjacent(t: Tensor) -> Tensor:
    """(B, D, T) ``t`` with channels adjacent in memory, the compiled kernels' output layout (a
    copy only for the torch path's): a custom op's outputs need one layout its fake can state."""
    return (
        t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)
    )


def _empty_channels_adjacent(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[2], x.shape[1]).transpose(1, 2)


@torch.library.custom_op("lorafuse::causal_conv1d", mutates_args=())
def causal_conv1d_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, initial_state: Tensor | None,
    activation: str | None, cu_seqlens: Tensor | None, n: int, backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(y, final_state)``: the backends' forward contract, y with channels adjacent."""
    fwd, _ = _implementation(backend)
    y, final = fwd(x, weight, bias, activation, initial_state, cu_seqlens, n)
    return _channels_adjacent(y), final


@causal_conv1d_op.register_fake
def _(x, weight, bias, initial_state, activation, cu_seqlens, n, backend):
    return _empty_channels_adjacent(x), x.new_empty(n, x.shape[1], weight.shape[1] - 1)


@torch.library.custom_op("lorafuse::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward_op(
    dy: Tensor, dfinal: Tensor | None, x: Tensor, weight: Tensor, bias: Tensor | None,
    activation: str | None, initial_state: Tensor | None, cu_seqlens: Tensor | None, n: int,
    needs: list[bool], backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dx, dweight, dbias, dinitial_state)``; each 0-size unless asked for in ``needs``."""
    _, bwd = _implementation(backend)
    grads = bwd(dy, dfinal, x, weight, bias, activation, initial_state, cu_seqlens, n,
                tuple(needs))  # fmt: skip
    dx, *rest = grads
    likes = (x, weight, bias if bias is not None else weight,
             initial_state if initial_state is not None else x)  # fmt: skip
    grads = (None if dx is None else _channels_adjacent(dx), *rest)
    return tuple(custom_ops.grad_or_empty(d if need else None, like)
                 for d, need, like in zip(grads, needs, likes))  # fmt: skip


@causal_conv1d_backward_op.register_fake
def _(dy, dfinal, x, weight, bias, activation, initial_state, cu_seqlens, n, needs, backend):
    likes = (weight, bias if bias is not None else weight,
             initial_state if initial_state is not None else x)  # fmt: skip
    dx = _empty_channels_adjacent(x) if needs[0] else x.new_empty(0)
    return (dx, *(t.new_empty(t.shape) if need else t.new_empty(0)
                  for t, need in zip(likes, needs[1:])))  # fmt: skip


def _causal_conv1d_setup(ctx, inputs, output):
    x, weight, bias, initial_state, activation, cu_seqlens, n, backend = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
    ctx.activation, ctx.n, ctx.backend = activation, n, backend


def _causal_conv1d_grad(ctx, dy, dfinal):
    needs = [bool(v) for v in ctx.needs_input_grad[:4]]
    if not any(needs):
        return (None,) * 8
    x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy
    grads = causal_conv1d_backward_op(dy, dfinal, x, weight, bias, ctx.activation, initial_state,
                                      cu_seqlens, ctx.n, needs, ctx.backend)  # fmt: skip
    return (*(d if need else None for d, need in zip(grads, needs)), None, None, None, None)


causal_conv1d_op.register_autograd(_causal_conv1d_grad, setup_context=_causal_conv1d_setup)
