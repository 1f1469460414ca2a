"""Fused LoRA Q/K/V projections: three LoRA linears over one input, one autograd node.

``q, k, v = proj_q(x), proj_k(x), proj_v(x)``, each ``x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ``
(:class:`~lorafuse.ops.lora_params.LoRAParams`; a projection without adapter is a plain frozen
linear). GQA: k and v may have fewer output features than q.

Shapes (after flattening the leading dims): x (N, d); W_q (Hq·D, d), W_k/W_v (Hk·D, d);
A (r, d); B (out, r); outputs (N, out) each, reshaped back to (..., out).

* Saved for backward: ``x`` once (in its own dtype); ``xa`` (N, r) per adapter; dropout masks
  as bool (1 byte/element). Stock PEFT with ``lora_dropout > 0`` keeps, per projection, the
  dropped input (N, d) in the adapter dtype and its mask in that dtype too; with an fp32 adapter
  on a bf16 base it keeps an fp32 copy of x per projection even without dropout.
  Quantized base weights are dequantized in forward and again in backward, never saved.
* Backward sums the three input gradients into one ``dx`` (stock autograd adds three (N, d)
  tensors through separate nodes).
* Dropout masks are drawn in the order q, k, v — the order of PEFT's three sequential module
  calls in ``LlamaAttention.forward`` — each as ``nn.Dropout`` draws it on the adapter-dtype
  input, so a seeded CPU run matches stock PEFT mask for mask (CUDA's ``nn.Dropout`` is a
  fused Philox kernel: same distribution, different draws).
* Runs the selected backend's ``lora_linear`` kernels (contract 1) per projection.
"""

from __future__ import annotations

import torch

from lorafuse import backends
from lorafuse.ops import lora_linear as _lin
from lorafuse.ops.lora_linear import lora_linear_reference
from lorafuse.ops.lora_params import (
    LoRAParams,
    check_params,
    draw_mask,
    project_backward,
    project_forward,
)
from lorafuse.ops.weights import is_quantized, materialize

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
    """Inputs: x, then (weight, bias, lora_A, lora_B) for q, k, v; then static info."""

    @staticmethod
    def forward(ctx, x, *args):
        tensors, (meta, backend) = args[:12], args[12:]
        params = [LoRAParams(*tensors[4 * i : 4 * i + 4], *meta[i]) for i in range(3)]
        fwd, _ = _lin._implementation(backend)
        outs, xas, masks = [], [], []
        for p in params:  # q, k, v: PEFT's call order, so the RNG draws line up
            mask = draw_mask(x.shape, p.lora_A, p.dropout_p, x.device)  # (N, d) bool
            y, xa = project_forward(fwd, x, materialize(p.weight, x.dtype), p, mask)
            outs.append(y)
            xas.append(xa)
            masks.append(mask)
        ctx.params = [
            p._replace(weight=p.weight if is_quantized(p.weight) else None, bias=None, lora_A=None,
                       lora_B=None)
            for p in params
        ]  # fmt: skip
        dense = [None if is_quantized(p.weight) else p.weight for p in params]
        ctx.save_for_backward(
            x, *dense, *(p.lora_A for p in params), *(p.lora_B for p in params), *xas, *masks
        )
        ctx.backend = backend
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        x = saved[0]
        dense, As, Bs, xas, masks = saved[1:4], saved[4:7], saved[7:10], saved[10:13], saved[13:16]
        need = ctx.needs_input_grad
        _, bwd = _lin._implementation(ctx.backend)
        out = [None] * 13
        dx = None
        for i, (p, w, a, b) in enumerate(zip(ctx.params, dense, As, Bs)):
            p = p._replace(weight=materialize(p.weight, x.dtype) if w is None else w, lora_A=a,
                           lora_B=b)  # fmt: skip
            want = (need[0], need[3 + 4 * i], need[4 + 4 * i], need[2 + 4 * i])  # dx, dA, dB, db
            dxi, dA, dB, db = project_backward(
                bwd, grads[i].contiguous(), x, p.weight, p, xas[i], masks[i], want
            )
            out[2 + 4 * i : 5 + 4 * i] = [db, dA, dB]
            if dxi is not None:
                dx = dxi if dx is None else dx.add_(dxi)
        out[0] = dx
        return (*out, None, None)


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
    _check(x, q, k, v)
    chosen = backends.select("lora_linear", x.device, backend)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()  # (N, d)
    params = [p if training else p._replace(dropout_p=0.0) for p in (q, k, v)]
    meta = tuple((float(p.scaling), float(p.dropout_p)) for p in params)
    flat = [t for p in params for t in (p.weight, p.bias, p.lora_A, p.lora_B)]
    outs = LoRAQKVFunction.apply(x2, *flat, meta, chosen)
    lead = x.shape[:-1]
    return tuple(o.reshape(*lead, p.out_features) for o, p in zip(outs, params))
