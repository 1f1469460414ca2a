"""Fused LoRA linear: ``y = x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ`` with a hand-written backward.

Shapes (after flattening the leading dims): x (N, d), W (k, d), b (k,), A (r, d), B (k, r).
Saved for backward: ``x`` once, ``xa = dropout(x)·Aᵀ`` (N, r) and the dropout mask as bool;
frozen W and b get no gradient and no copy. The base product runs in x's dtype, the LoRA branch
in the adapter's. Dtypes, dropout, autocast, the C++ fast path and the custom op: docs/kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import has_torch_function_variadic

from lorafuse import backends
from lorafuse.ops import autocast, custom_ops
from lorafuse.ops.lora_params import LoRAParams
from lorafuse.ops.lora_split import split_backward, split_forward
from lorafuse.ops.weights import is_quantized, materialize, tiled

# ---- Policy: the plain call runs as one C++ autograd Function (csrc/lora_autograd.cpp) ----


def _fast(x, weight, bias, lora_A, lora_B, scaling, backend):
    """The call through ``csrc/lora_autograd.cpp`` (docs/kernels.md), or None when it is
    not that call. The C++ entry point repeats :func:`_check`'s tests as a yes/no (and checks
    autocast), so anything it declines runs the general path, which raises the errors."""
    if (
        not isinstance(weight, torch.Tensor)  # quantized: dequantized per pass, general path
        or custom_ops.active()
        or has_torch_function_variadic(x, weight, bias, lora_A, lora_B)  # subclasses, modes
        or backends.select_cpu("lora_linear", backend) != "cpp"
    ):
        return None
    (fast,) = backends.compiled("lora_linear", "cpp", "fast")
    return fast(x, weight, bias, lora_A, lora_B, float(scaling))


# ---- The op: reference, autograd.Function, entry point ------------------------------------


def lora_linear_reference(x, weight, bias, lora_A, lora_B, scaling, noise=None):
    """Plain autograd math, written as PEFT computes it: the test oracle.

    ``noise`` is the dropout multiplier (mask / keep) or None.
    """
    result = F.linear(x, weight, bias)
    xl = x.to(lora_A.dtype)
    if noise is not None:
        xl = xl * noise
    return (result + F.linear(F.linear(xl, lora_A), lora_B) * scaling).to(result.dtype)


def _dropped(x, lora_A, mask, keep):
    """The LoRA branch input: x in the adapter dtype, with dropout applied.  (N, d)"""
    xl = x.to(lora_A.dtype)
    if mask is not None:
        xl = xl * mask.to(xl.dtype).div_(keep)  # same rounding as nn.Dropout's noise.div_(1-p)
    return xl


def _torch_forward(x, weight, bias, lora_A, lora_B, scaling, mask, keep):
    """Returns ``(y, xa)``: y (N, k) in x's dtype, xa = dropout(x)·Aᵀ (N, r) in the adapter dtype."""
    y = F.linear(x, weight, bias)  # (N, k)
    xa = F.linear(_dropped(x, lora_A, mask, keep), lora_A)  # (N, r)
    y = (y + F.linear(xa, lora_B) * scaling).to(x.dtype)
    return y, xa


def _torch_backward(g, x, weight, lora_A, lora_B, xa, scaling, mask, keep, needs):
    """Gradients ``(dx, dA, dB, db)``, each None unless asked for in ``needs``."""
    need_dx, need_dA, need_dB, need_db = needs
    dx = dA = dB = db = None
    gl = g.to(lora_B.dtype)  # (N, k)
    if need_dx or need_dA:
        gB = (gl @ lora_B).mul_(scaling)  # (N, r)
    if need_dB:
        dB = (gl.t() @ xa).mul_(scaling)  # (k, r)
    if need_dA:
        dA = gB.t() @ _dropped(x, lora_A, mask, keep)  # (r, d)
    if need_dx:
        dl = gB @ lora_A  # (N, d)
        if mask is not None:
            dl = dl * mask.to(dl.dtype).div_(keep)
        dx = (g @ weight + dl).to(x.dtype)
    if need_db:
        db = g.sum(0, dtype=torch.float32).to(g.dtype)
    return dx, dA, dB, db


def implementation(backend: str):
    """``(forward, backward)`` of ``backend`` with the contract of :func:`_torch_forward` /
    :func:`_torch_backward`, for ops built on this one (:mod:`lorafuse.ops.dora`,
    :mod:`lorafuse.ops.lora_projection`)."""
    if backend == "torch":
        return _torch_forward, _torch_backward
    return backends.compiled("lora_linear", backend, "forward", "backward")


class LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scaling, dropout_p, backend):
        mask = None
        keep = 1.0 - dropout_p
        if dropout_p > 0.0:
            # Same draw as nn.Dropout on the adapter-dtype input, stored compactly.
            mask = torch.empty(x.shape, dtype=lora_A.dtype, device=x.device).bernoulli_(keep)
            mask = mask.bool()  # (N, d)
        if tiled(weight, x.dtype):  # a quantized W by tiles, never whole (ops/lora_split.py)
            p = LoRAParams(weight, bias, lora_A, lora_B, float(scaling), dropout_p)
            (y,), (xa,) = split_forward(x, [p], [mask], backend=backend)
        else:
            fwd, _ = implementation(backend)
            dense = materialize(weight, x.dtype)  # (k, d); transient when quantized
            y, xa = fwd(x, dense, bias, lora_A, lora_B, float(scaling), mask, keep)
        ctx.quantized = weight if is_quantized(weight) else None
        ctx.save_for_backward(x, None if ctx.quantized else weight, lora_A, lora_B, xa, mask)
        ctx.scaling, ctx.dropout_p, ctx.keep, ctx.backend = float(scaling), dropout_p, keep, backend
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, lora_A, lora_B, xa, mask = ctx.saved_tensors
        needs = ctx.needs_input_grad
        want = (needs[0], needs[3], needs[4], needs[2])  # dx, dA, dB, db
        with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
            if ctx.quantized is not None and tiled(ctx.quantized, x.dtype):
                p = LoRAParams(ctx.quantized, None, lora_A, lora_B, ctx.scaling, ctx.dropout_p)
                dx, ((db, dA, dB),) = split_backward(
                    [g.contiguous()], x, [p], [xa], want[0], [want[1:]], [mask],
                    backend=ctx.backend,
                )  # fmt: skip
                return dx, None, db, dA, dB, None, None, None
            if ctx.quantized is not None:
                weight = materialize(ctx.quantized, x.dtype)  # dequantize again, not kept
            _, bwd = implementation(ctx.backend)
            dx, dA, dB, db = bwd(
                g.contiguous(), x, weight, lora_A, lora_B, xa, ctx.scaling, mask, ctx.keep, want
            )
        return dx, None, db, dA, dB, None, None, None


def via_custom_op(x, weight, bias, lora_A, lora_B, scaling, dropout_p, backend):
    """:class:`LoRALinearFunction`'s work through the ``lorafuse::lora_linear`` custom op: the
    mask is drawn (same draw) and a quantized weight dequantized here, outside the op."""
    keep = 1.0 - dropout_p
    mask = None
    if dropout_p > 0.0:
        mask = torch.empty(x.shape, dtype=lora_A.dtype, device=x.device).bernoulli_(keep).bool()
    dense = materialize(weight, x.dtype)  # (k, d); saved by the op when quantized (not covered)
    y, _xa = lora_linear_op(x, dense, bias, lora_A, lora_B, float(scaling), mask, keep, backend)
    return y


def _check(x, weight, bias, lora_A, lora_B, dropout_p):
    d = x.shape[-1]
    k = weight.shape[0]
    r = lora_A.shape[0]
    if len(weight.shape) != 2 or weight.shape[1] != d:
        raise ValueError(
            f"weight must be (out, {d}) for input (..., {d}), got {tuple(weight.shape)}"
        )
    if lora_A.dim() != 2 or lora_A.shape[1] != d:
        raise ValueError(f"lora_A must be (r, {d}), got {tuple(lora_A.shape)}")
    if lora_B.dim() != 2 or lora_B.shape != (k, r):
        raise ValueError(
            f"lora_B must be ({k}, {r}) for weight {tuple(weight.shape)} and "
            f"lora_A {tuple(lora_A.shape)}, got {tuple(lora_B.shape)}"
        )
    if bias is not None and bias.shape != (k,):
        raise ValueError(f"bias must be ({k},), got {tuple(bias.shape)}")
    if not is_quantized(weight) and x.dtype != weight.dtype:
        raise ValueError(f"input dtype {x.dtype} does not match weight dtype {weight.dtype}")
    if not is_quantized(weight) and weight.requires_grad and torch.is_grad_enabled():
        # No base-weight gradient is computed: refuse rather than freeze it silently.
        raise ValueError(
            "weight requires grad, but lora_linear treats the base weight as frozen; "
            "freeze it (weight.requires_grad_(False)) or run the layer unfused"
        )
    if lora_A.dtype != lora_B.dtype:
        raise ValueError(f"lora_A ({lora_A.dtype}) and lora_B ({lora_B.dtype}) dtypes differ")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float = 1.0,
    dropout_p: float = 0.0,
    training: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """``x·Wᵀ + b + scaling·(dropout(x)·Aᵀ)·Bᵀ`` over any leading shape of ``x``."""
    if x.is_cpu and (dropout_p == 0.0 or (not training and 0.0 < dropout_p < 1.0)):
        y = _fast(x, weight, bias, lora_A, lora_B, scaling, backend)
        if y is not None:
            return y
    dt = autocast.autocast_dtype(x)
    if dt is not None:  # as autocast runs F.linear: operands in its dtype, then autocast off
        with autocast.disabled(x.device):
            args = (autocast.cast(t, dt) for t in (x, weight, bias, lora_A, lora_B))
            return lora_linear(*args, scaling, dropout_p, training, backend)
    _check(x, weight, bias, lora_A, lora_B, dropout_p)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (N, d); a permuted view (SDXL proj_in) copies
    chosen = backends.select("lora_linear", x.device, backend)
    p = dropout_p if training else 0.0
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        y = via_custom_op(x2, weight, bias, lora_A, lora_B, scaling, p, chosen)
    else:
        y = LoRALinearFunction.apply(x2, weight, bias, lora_A, lora_B, scaling, p, chosen)
    return y.reshape(*lead, weight.shape[0])


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::lora_linear", mutates_args=())
def lora_linear_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    mask: Tensor | None,
    keep: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """``(y (N, k), xa (N, r))``: :func:`lorafuse.ops.lora_linear._torch_forward`'s contract."""
    fwd, _ = implementation(backend)
    return tuple(fwd(x, weight, bias, lora_A, lora_B, scaling, mask, keep))


@lora_linear_op.register_fake
def _(x, weight, bias, lora_A, lora_B, scaling, mask, keep, backend):
    n = x.shape[0]
    return x.new_empty(n, weight.shape[0]), x.new_empty(n, lora_A.shape[0], dtype=lora_A.dtype)


@torch.library.custom_op("lorafuse::lora_linear_backward", mutates_args=())
def lora_linear_backward_op(
    g: Tensor,
    x: Tensor,
    weight: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    xa: Tensor,
    scaling: float,
    mask: Tensor | None,
    keep: float,
    needs: list[bool],
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dA, dB, db)``; each a 0-size tensor unless asked for in ``needs`` (same order)."""
    _, bwd = implementation(backend)
    with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
        grads = bwd(
            g.contiguous(), x, weight, lora_A, lora_B, xa, scaling, mask, keep, tuple(needs)
        )
    return tuple(custom_ops.grad_or_empty(t, g) for t in grads)


@lora_linear_backward_op.register_fake
def _(g, x, weight, lora_A, lora_B, xa, scaling, mask, keep, needs, backend):
    shapes = ((x.shape, x.dtype), (lora_A.shape, lora_A.dtype), (lora_B.shape, lora_B.dtype),
              ((weight.shape[0],), g.dtype))  # fmt: skip
    return tuple(
        g.new_empty(s, dtype=dt) if need else g.new_empty(0) for need, (s, dt) in zip(needs, shapes)
    )


def _lora_linear_setup(ctx, inputs, output):
    x, weight, _bias, lora_A, lora_B, scaling, mask, keep, backend = inputs
    ctx.save_for_backward(x, weight, lora_A, lora_B, output[1], mask)
    ctx.scaling, ctx.keep, ctx.backend = scaling, keep, backend


def _lora_linear_grad(ctx, g, _g_xa):
    x, weight, lora_A, lora_B, xa, mask = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[3], n[4], n[2]]  # dx, dA, dB, db: the kernels' order
    if not any(needs):
        return (None,) * 9
    dx, dA, dB, db = lora_linear_backward_op(
        g, x, weight, lora_A, lora_B, xa, ctx.scaling, mask, ctx.keep, needs, ctx.backend
    )
    pick = [t if need else None for t, need in zip((dx, dA, dB, db), needs)]
    return pick[0], None, pick[3], pick[1], pick[2], None, None, None, None


lora_linear_op.register_autograd(_lora_linear_grad, setup_context=_lora_linear_setup)
