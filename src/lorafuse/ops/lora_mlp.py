"""Fused LoRA SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with a hand-written backward
(``activation="gelu_tanh"``: Gemma's GeGLU, :mod:`lorafuse.ops.geglu`).

Each projection is a :class:`~lorafuse.ops.lora_params.LoRAParams` (no adapter = a plain frozen
linear). Shapes: x (N, d); gate/up W (I, d), A (r, d), B (I, r); down W (d, I), A (r, I), B (d,
r); y (N, d). Saved for backward: x once, gate and up (N, I) once each, ``xa`` (N, r) per adapter,
dropout masks as bool; ``h = silu(gate)*up`` is recomputed. Stacked gate/up products, dropout
order, autocast: docs/kernels.md.
"""

from __future__ import annotations

import torch

from lorafuse import backends, hardware
from lorafuse.ops import autocast, custom_ops, geglu
from lorafuse.ops import swiglu as _act
from lorafuse.ops.lora_linear import lora_linear_reference
from lorafuse.ops.lora_params import LoRAParams, check_params
from lorafuse.ops.lora_projection import (
    cast_params,
    draw_mask,
    flatten,
    input_grads,
    input_needs,
    meta_of,
    project_backward,
    project_custom_op,
    project_forward,
    save_projections,
    saved_projections,
    stackable,
    unflatten,
)
from lorafuse.ops.lora_split import split_backward, split_forward
from lorafuse.ops.weights import materialize

__all__ = ["LoRAParams", "lora_mlp", "lora_mlp_reference"]


def _ref_proj(x, p: LoRAParams, noise):
    dense = materialize(p.weight, x.dtype)
    if not p.has_lora:
        return torch.nn.functional.linear(x, dense, p.bias)
    return lora_linear_reference(x, dense, p.bias, p.lora_A, p.lora_B, p.scaling, noise)


ACTIVATIONS = ("silu", "gelu_tanh")


def _activation(activation: str, backend: str):
    """(forward, backward) of the activation kernel: SwiGLU's of ``backend``, or GeGLU's."""
    if activation == "gelu_tanh":
        return geglu.geglu_forward, geglu.geglu_backward
    return _act.implementation(backend)


def lora_mlp_reference(x, gate: LoRAParams, up: LoRAParams, down: LoRAParams, noises=(None,) * 3,
                       activation: str = "silu"):  # fmt: skip
    """Plain autograd math, as PEFT-wrapped ``LlamaMLP`` (``Gemma3MLP`` for ``"gelu_tanh"``)
    computes it: the test oracle.

    ``noises`` are the dropout multipliers (mask / keep) for gate, up, down, or None.
    """
    z = _ref_proj(x, gate, noises[0])
    gelu = torch.nn.functional.gelu
    act = gelu(z, approximate="tanh") if activation == "gelu_tanh" else torch.nn.functional.silu(z)
    return _ref_proj(act * _ref_proj(x, up, noises[1]), down, noises[2])


def stack_gate_up(gate: LoRAParams, up: LoRAParams, backend: str, x: torch.Tensor) -> bool:
    """Whether gate and up run their A products stacked (:func:`~lorafuse.ops.lora_projection.
    stackable`): only where that measured faster, i.e. where the LoRA products run in another
    dtype than the base's (PEFT's fp32 adapters on a bf16 base), so each projection's kernel
    casts x (N, d) again. ``benchmarks/probes/stacked_rank_products.py`` (fwd+bwd, N = 2048, r = 16,
    per-projection / stacked, SmolLM2-135M and llama-4l-1024 shapes, 3-5 runs on a shared box):
    fp32 adapters on bf16 median 1.10x (0.92-1.29); fp32 median 1.04x (0.93-1.23) and bf16
    adapters on bf16 median 0.99x (0.91-1.02): not clearly faster (the wide gate/up GEMMs
    dominate and stacking does not shorten them), so those keep one kernel each.
    """
    if not stackable((gate, up), backend):
        return False
    adapter = hardware.matmul_dtype(x.device, gate.lora_A.dtype)
    return adapter != hardware.matmul_dtype(x.device, x.dtype)


def _gate_up_backward(backend, grads, s, params, need_dx: bool, wants):
    """gate's and up's backward, one ``lora_linear`` kernel each: ``(dx, [(db, dA, dB)] * 2)``."""
    dx, out = None, []
    for i, (g, p) in enumerate(zip(grads, params)):
        dxi, dA, dB, db = project_backward(
            g, s.x, p, s.xa[i], s.mask[i], (need_dx, *wants[i]), backend
        )
        out.append((db, dA, dB))
        if dxi is not None:
            dx = dxi if dx is None else dx.add_(dxi)  # (N, d)
    return dx, out


class LoRAMLPFunction(torch.autograd.Function):
    """Inputs: x, then ``flatten((gate, up, down))`` (lora_params), then static info: meta, the
    linear and activation backends, and ``stacked`` (gate and up through the shared-input path of
    :func:`~lorafuse.ops.lora_projection.stackable`; False: one ``lora_linear`` kernel each)."""

    @staticmethod
    def forward(ctx, x, *args):
        *tensors, meta, lin_backend, act_backend, activation, stacked = args
        gp, upp, dp = params = unflatten(tensors, meta)
        if stacked and not stackable((gp, upp), lin_backend):  # the rule; stack_gate_up: policy
            raise ValueError("lora_mlp: stacked=True needs gate and up adapters of one dtype, "
                             "no dropout")  # fmt: skip
        act_fwd, _ = _activation(activation, act_backend)
        if stacked:  # one x·[A_gate; A_up]ᵀ; no dropout, so no masks to draw
            # gate, up (N, I); xa_g, xa_u (N, r)
            (gate, up), (xa_g, xa_u) = split_forward(x, (gp, upp), backend=lin_backend)
            mask_g = mask_u = None
        else:
            mask_g = draw_mask(x.shape, gp.lora_A, gp.dropout_p, x.device)  # (N, d), PEFT order
            gate, xa_g = project_forward(x, gp, mask_g, lin_backend)
            mask_u = draw_mask(x.shape, upp.lora_A, upp.dropout_p, x.device)  # (N, d)
            up, xa_u = project_forward(x, upp, mask_u, lin_backend)
        h = act_fwd(gate, up)  # (N, I); transient
        mask_d = draw_mask(h.shape, dp.lora_A, dp.dropout_p, x.device)  # (N, I)
        y, xa_d = project_forward(h, dp, mask_d, lin_backend)
        del h
        save_projections(
            ctx, params, x=x, gate=gate, up=up,  # (N, d), (N, I), (N, I)
            xa=(xa_g, xa_u, xa_d), mask=(mask_g, mask_u, mask_d),
        )  # fmt: skip
        ctx.backends, ctx.stacked, ctx.activation = (lin_backend, act_backend), stacked, activation
        return y

    @staticmethod
    def backward(ctx, g):
        (gp, upp, dp), s = saved_projections(ctx)
        need = ctx.needs_input_grad
        wants = [input_needs(need, i) for i in range(3)]  # (dA, dB, db) for gate, up, down
        act_fwd, act_bwd = _activation(ctx.activation, ctx.backends[1])
        need_dh = need[0] or any(any(w) for w in wants[:2])
        grads = [(None, None, None)] * 3  # (db, dA, dB) per projection
        dx = None
        with autocast.disabled(g.device):  # a backward called inside autocast: same dtypes
            h = act_fwd(s.gate, s.up)  # (N, I) recomputed instead of saved
            dh, dA_d, dB_d, db_d = project_backward(
                g.contiguous(), h, dp, s.xa[2], s.mask[2], (need_dh, *wants[2]), ctx.backends[0]
            )
            del h
            grads[2] = (db_d, dA_d, dB_d)
            if need_dh:
                # (N, I) each; dgate into dh's buffer: gate, up, dgate, dup are the four alive
                dgate, dup = act_bwd(dh, s.gate, s.up, dgate_into_g=True)
                del dh
                if ctx.stacked:
                    dx, grads[:2] = split_backward(
                        (dgate, dup), s.x, (gp, upp), s.xa[:2], need[0], wants[:2],
                        backend=ctx.backends[0],
                    )  # (N, d); (db, dA, dB) for gate and up  # fmt: skip
                else:
                    dx, grads[:2] = _gate_up_backward(
                        ctx.backends[0], (dgate, dup), s, (gp, upp), need[0], wants[:2]
                    )  # one lora_linear backward per projection
        return (dx, *input_grads(grads), None, None, None, None, None)


def _check(x, gate, up, down):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise ValueError(
            f"lora_mlp: x must be a floating-point tensor (..., d), got {getattr(x, 'dtype', type(x).__name__)}"
        )
    d = x.shape[-1]
    check_params(gate, d, x.dtype, "gate")
    check_params(up, d, x.dtype, "up")
    if gate.out_features != up.out_features:
        raise ValueError(
            f"lora_mlp: gate {tuple(gate.weight.shape)} and up {tuple(up.weight.shape)} "
            "must have the same out_features"
        )
    if down.out_features != d:
        raise ValueError(
            f"lora_mlp: down.weight must be ({d}, {gate.out_features}), "
            f"got {tuple(down.weight.shape)}"
        )
    check_params(down, gate.out_features, x.dtype, "down")


def lora_mlp(
    x: torch.Tensor,
    gate: LoRAParams,
    up: LoRAParams,
    down: LoRAParams,
    training: bool = True,
    backend: str | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` over any leading shape of ``x`` (..., d) -> (..., d);
    ``activation`` "silu" (SwiGLU) or "gelu_tanh" (GeGLU, eager only)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"lora_mlp: activation must be one of {ACTIVATIONS}, got {activation!r}")
    dt = autocast.autocast_dtype(x)
    if dt is not None:  # as autocast runs each F.linear: operands in its dtype, then autocast off
        with autocast.disabled(x.device):
            mlp = (cast_params(p, dt) for p in (gate, up, down))
            return lora_mlp(autocast.cast(x, dt), *mlp, training=training, backend=backend,
                            activation=activation)  # fmt: skip
    _check(x, gate, up, down)
    lin_backend = backends.select("lora_linear", x.device, backend)
    # GeGLU has the torch kernel only (ops.geglu)
    act_backend = (
        "torch" if activation == "gelu_tanh" else backends.select("swiglu", x.device, backend)
    )
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()  # (N, d)
    params = [p if training else p._replace(dropout_p=0.0) for p in (gate, up, down)]
    if custom_ops.active() and activation != "silu":
        raise NotImplementedError("lora_mlp: the GeGLU MLP under torch.compile is not supported "
                                  "(run it eagerly)")  # fmt: skip
    if custom_ops.active():  # torch.compile: four graph nodes (see lorafuse.ops.custom_ops)
        gp, upp, dp = params  # projections in PEFT's call (and dropout draw) order
        gate = project_custom_op(x2, gp, lin_backend)  # (N, I)
        up = project_custom_op(x2, upp, lin_backend)  # (N, I)
        h = _act.swiglu_op(gate, up, act_backend)  # (N, I); saved for down's backward
        y = project_custom_op(h, dp, lin_backend)  # (N, d)
    else:
        stacked = stack_gate_up(params[0], params[1], lin_backend, x2)
        y = LoRAMLPFunction.apply(
            x2, *flatten(params), meta_of(params), lin_backend, act_backend, activation, stacked
        )
    return y.reshape(*x.shape[:-1], d)
