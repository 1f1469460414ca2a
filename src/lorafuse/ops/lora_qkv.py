"""Fused LoRA Q/K/V projections: three LoRA linears over one input, one autograd node.

Each of q, k, v is ``x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ`` (a
:class:`~lorafuse.ops.lora_params.LoRAParams`; no adapter = a plain frozen linear); GQA's k and v
may be narrower. Shapes: x (N, d); W_q (Hq·D, d), W_k/W_v (Hk·D, d); A (r, d); B (out, r);
outputs (N, out) each. Saved for backward: x once, ``xa`` (N, r) per adapter, dropout masks as
bool; quantized weights are dequantized again, never saved. Backward sums the three input
gradients into one dx. Dropout order, stacked A products, autocast: docs/kernels.md.
"""

from __future__ import annotations

import torch

from lorafuse import backends
from lorafuse.ops import autocast, custom_ops
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

__all__ = ["LoRAParams", "lora_qkv", "lora_qkv_reference"]


def lora_qkv_reference(x, q: LoRAParams, k: LoRAParams, v: LoRAParams, noises=(None,) * 3):
    """Plain autograd math, three PEFT LoRA Linear calls: the test oracle.

    ``noises`` are the dropout multipliers (mask / keep) for q, k, v, or None.
    """
    out = []
    for p, noise in zip((q, k, v), noises):
        dense = materialize(p.weight, x.dtype)
        if p.has_lora:
            out.append(
                lora_linear_reference(x, dense, p.bias, p.lora_A, p.lora_B, p.scaling, noise)
            )
        else:
            out.append(torch.nn.functional.linear(x, dense, p.bias))
    return tuple(out)


class LoRAQKVFunction(torch.autograd.Function):
    """Inputs: x, then ``flatten((q, k, v))`` (lora_params), then static info: meta, backend,
    and ``stacked`` (run the shared-input path of :func:`~lorafuse.ops.lora_projection.stackable`;
    False: one ``lora_linear`` kernel per projection)."""

    @staticmethod
    def forward(ctx, x, *args):
        *tensors, meta, backend, stacked = args
        params = unflatten(tensors, meta)
        if stacked and not stackable(params, backend):
            raise ValueError("lora_qkv: stacked=True needs >= 2 adapters of one dtype, no dropout")
        if stacked:  # one x·[A_q; A_k; A_v]ᵀ; no dropout, so no masks to draw
            # outs (N, out_i); xas (N, r_i) views or None
            outs, xas = split_forward(x, params, backend=backend)
            masks = [None] * 3
        else:
            outs, xas, masks = [], [], []
            for p in params:  # q, k, v: PEFT's call order, so the RNG draws line up
                mask = draw_mask(x.shape, p.lora_A, p.dropout_p, x.device)  # (N, d) bool
                y, xa = project_forward(x, p, mask, backend)
                outs.append(y)  # (N, out_i)
                xas.append(xa)  # (N, r) or None
                masks.append(mask)
        save_projections(ctx, params, x=x, xa=xas, mask=masks)
        ctx.backend, ctx.stacked = backend, stacked
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        params, saved = saved_projections(ctx)
        x, need = saved.x, ctx.needs_input_grad
        if ctx.stacked:
            with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
                gs = [g.contiguous() for g in grads]
                wants = [input_needs(need, i) for i in range(3)]
                dx, per_projection = split_backward(
                    gs, x, params, saved.xa, need[0], wants, backend=ctx.backend
                )
            return (dx, *input_grads(per_projection), None, None, None)
        dx, per_projection = None, []
        with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
            for i, (p, g) in enumerate(zip(params, grads)):
                need_dA, need_dB, need_db = input_needs(need, i)
                dxi, dA, dB, db = project_backward(
                    g.contiguous(), x, p, saved.xa[i], saved.mask[i],
                    (need[0], need_dA, need_dB, need_db), ctx.backend,
                )  # fmt: skip
                per_projection.append((db, dA, dB))
                if dxi is not None:
                    dx = dxi if dx is None else dx.add_(dxi)  # (N, d): one sum for three inputs
        return (dx, *input_grads(per_projection), None, None, None)


def _check(x, q, k, v):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"lora_qkv: x must be a floating-point tensor (..., d), got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")  # fmt: skip
    d = x.shape[-1]
    for name, p in (("q", q), ("k", k), ("v", v)):
        check_params(p, d, x.dtype, name)


def lora_qkv(
    x: torch.Tensor,
    q: LoRAParams,
    k: LoRAParams,
    v: LoRAParams,
    training: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V projections of ``x`` (..., d); returns ``(q, k, v)`` of shape (..., out_i)."""
    dt = autocast.autocast_dtype(x)
    if dt is not None:  # as autocast runs each F.linear: operands in its dtype, then autocast off
        with autocast.disabled(x.device):
            qkv = (cast_params(p, dt) for p in (q, k, v))
            return lora_qkv(autocast.cast(x, dt), *qkv, training=training, backend=backend)
    _check(x, q, k, v)
    chosen = backends.select("lora_linear", x.device, backend)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()  # (N, d)
    params = [p if training else p._replace(dropout_p=0.0) for p in (q, k, v)]
    if custom_ops.active():  # torch.compile: three graph nodes (see lorafuse.ops.custom_ops)
        outs = [project_custom_op(x2, p, chosen) for p in params]  # q, k, v: PEFT's draw order
    else:
        stacked = stackable(
            params, chosen
        )  # measured faster: benchmarks/probes/stacked_rank_products.py
        outs = LoRAQKVFunction.apply(x2, *flatten(params), meta_of(params), chosen, stacked)
    lead = x.shape[:-1]
    return tuple(o.reshape(*lead, p.out_features) for o, p in zip(outs, params))
