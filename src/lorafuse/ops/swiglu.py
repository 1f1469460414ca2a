"""Fused SwiGLU activation: ``h = silu(gate) * up`` with a hand-written backward.

Shapes (after flattening the leading dims): gate (N, I), up (N, I), h (N, I).

* Fused: sigmoid, the silu product and the gating multiply are one elementwise pass, in fp32,
  with one rounding to the output dtype (HF's ``act_fn(gate) * up`` rounds twice in bf16).
* Saved for backward: ``gate`` and ``up`` only (their own dtype); ``sigmoid(gate)`` and
  ``silu(gate)`` are recomputed in backward — no (N, I) activation is stored. Backward can write
  dgate into the incoming gradient's buffer (``dgate_into_g``; the fused MLP's dh).

Backends (chosen in :mod:`lorafuse.backends`): ``torch`` (this file), ``cpp``
(``csrc/swiglu.cpp``: ``swiglu_forward``/``swiglu_backward``), ``triton``
(``triton/swiglu.py``: ``forward``/``backward``), all implementing the contract of
:func:`_torch_forward` / :func:`_torch_backward`.

Under ``torch.compile`` (end of this file): ``lorafuse::swiglu(gate, up, backend) -> h``;
backward ``swiglu_backward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import custom_ops


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain autograd math, as ``LlamaMLP`` computes it (``ACT2FN['silu'](gate) * up``)."""
    return F.silu(gate) * up


def _torch_forward(gate, up):
    """``h (N, I)`` in gate's dtype, computed in fp32."""
    g32 = gate.to(torch.float32)
    return (F.silu(g32) * up.to(torch.float32)).to(gate.dtype)


def _torch_backward(g, gate, up, dgate_into_g=False):
    """``(dgate, dup)`` (N, I) in gate's / up's dtype; recomputes sigmoid(gate). ``dgate_into_g``:
    the caller is done with ``g`` (the fused MLP's own dh), so dgate may be written into its
    buffer where the dtypes agree (one (N, I) tensor fewer alive)."""
    z = gate.to(torch.float32)
    s = torch.sigmoid(z)  # (N, I)
    g32 = g.to(torch.float32)
    dup = (g32 * z * s).to(up.dtype)
    # d silu(z)/dz = s·(1 + z·(1 - s))
    dgate = g32 * up.to(torch.float32) * s * (1.0 + z * (1.0 - s))
    if dgate_into_g and g.dtype == gate.dtype:
        return g.copy_(dgate), dup
    return dgate.to(gate.dtype), dup


def implementation(backend: str):
    """``(forward, backward)`` of ``backend`` with the contract of :func:`_torch_forward` /
    :func:`_torch_backward` (also for :mod:`lorafuse.ops.lora_mlp`)."""
    if backend == "torch":
        return _torch_forward, _torch_backward
    return backends.compiled("swiglu", backend, "forward", "backward")


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, backend):
        fwd, _ = implementation(backend)
        ctx.save_for_backward(gate, up)
        ctx.backend = backend
        return fwd(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, None
        _, bwd = implementation(ctx.backend)
        dgate, dup = bwd(g.contiguous(), gate, up)
        return (
            dgate if ctx.needs_input_grad[0] else None,
            dup if ctx.needs_input_grad[1] else None,
            None,
        )


def check_swiglu(gate, up) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} shapes differ")
    if gate.dtype != up.dtype or not gate.is_floating_point():
        raise ValueError(
            f"swiglu: gate ({gate.dtype}) and up ({up.dtype}) must share a float dtype"
        )
    if gate.device != up.device:
        raise ValueError(f"swiglu: gate on {gate.device}, up on {up.device}")
    if gate.dim() == 0:
        raise ValueError("swiglu: inputs must have at least one dimension")


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` over any shape (gate and up equal); returns gate's shape and dtype."""
    check_swiglu(gate, up)
    shape = gate.shape
    chosen = backends.select("swiglu", gate.device, backend)
    g2 = gate.reshape(-1, shape[-1]).contiguous()  # (N, I)
    u2 = up.reshape(-1, shape[-1]).contiguous()  # (N, I)
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        return swiglu_op(g2, u2, chosen).reshape(shape)
    return SwiGLUFunction.apply(g2, u2, chosen).reshape(shape)


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    """``silu(gate) * up`` (N, I): :func:`lorafuse.ops.swiglu._torch_forward`'s contract."""
    fwd, _ = implementation(backend)
    return fwd(gate, up)


@swiglu_op.register_fake
def _(gate, up, backend):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("lorafuse::swiglu_backward", mutates_args=())
def swiglu_backward_op(g: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """``(dgate, dup)`` (N, I)."""
    _, bwd = implementation(backend)
    return tuple(bwd(g.contiguous(), gate, up))


@swiglu_backward_op.register_fake
def _(g, gate, up, backend):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    gate, up, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.backend = backend


def _swiglu_grad(ctx, g):
    gate, up = ctx.saved_tensors
    need_g, need_u = ctx.needs_input_grad[:2]
    if not (need_g or need_u):
        return None, None, None
    dgate, dup = swiglu_backward_op(g, gate, up, ctx.backend)
    return (dgate if need_g else None), (dup if need_u else None), None


swiglu_op.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)
