"""Fused LoRA SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with a hand-written backward.

Each projection is a :class:`~lorafuse.ops.lora_params.LoRAParams`: base ``W (+ b)`` plus an
optional LoRA adapter ``s·(dropout(x)·Aᵀ)·Bᵀ``; a projection without adapter is a plain frozen
linear, so a model with LoRA on only some MLP projections still takes this path.

Shapes (after flattening the leading dims): x (N, d); gate/up W (I, d), A (r, d), B (I, r);
down W (d, I), A (r, I), B (d, r); y (N, d).

* Composed from the selected backend's ``lora_linear`` and ``swiglu`` kernels (contracts 1, 4).
* Saved for backward: ``x`` once; the gate and up projections (N, I) each once; the rank-r
  products ``xa`` (N, r) per adapter; dropout masks as ``bool``. The activation
  ``h = silu(gate)*up`` (N, I) — the down projection's input — is recomputed in backward, not
  stored (stock autograd keeps it plus ``silu(gate)``: two more (N, I) tensors per layer).
  Quantized base weights are dequantized in forward and again in backward, never saved.
* Dropout masks are drawn in PEFT's call order — gate, up, down — each as ``nn.Dropout`` draws
  it on the adapter-dtype input of its own module, so a seeded CPU run matches stock PEFT
  (CUDA's ``nn.Dropout`` is a fused Philox kernel: same distribution, different draws).
"""

from __future__ import annotations

import torch

from lorafuse import backends
from lorafuse.ops import lora_linear as _lin
from lorafuse.ops import swiglu as _act
from lorafuse.ops.lora_linear import lora_linear_reference
from lorafuse.ops.lora_params import (
    LoRAParams,
    check_params,
    draw_mask,
    project_backward,
    project_forward,
)
from lorafuse.ops.weights import is_quantized, materialize

__all__ = ["LoRAParams", "lora_mlp", "lora_mlp_reference"]


def _ref_proj(x, p: LoRAParams, noise):
    dense = materialize(p.weight, x.dtype)
    if not p.has_lora:
        return torch.nn.functional.linear(x, dense, p.bias)
    return lora_linear_reference(x, dense, p.bias, p.lora_A, p.lora_B, p.scaling, noise)


def lora_mlp_reference(x, gate: LoRAParams, up: LoRAParams, down: LoRAParams, noises=(None,) * 3):
    """Plain autograd math, as PEFT-wrapped ``LlamaMLP`` computes it: the test oracle.

    ``noises`` are the dropout multipliers (mask / keep) for gate, up, down, or None.
    """
    act = torch.nn.functional.silu(_ref_proj(x, gate, noises[0]))
    return _ref_proj(act * _ref_proj(x, up, noises[1]), down, noises[2])


class LoRAMLPFunction(torch.autograd.Function):
    """Inputs: x, then (weight, bias, lora_A, lora_B) for gate, up, down; then static info."""

    @staticmethod
    def forward(ctx, x, *args):
        tensors, (meta, lin_backend, act_backend) = args[:12], args[12:]
        params = [LoRAParams(*tensors[4 * i : 4 * i + 4], *meta[i]) for i in range(3)]
        lin_fwd, _ = _lin._implementation(lin_backend)
        act_fwd, _ = _act._implementation(act_backend)
        gp, upp, dp = params
        mask_g = draw_mask(x.shape, gp.lora_A, gp.dropout_p, x.device)  # (N, d), PEFT order
        gate, xa_g = project_forward(lin_fwd, x, materialize(gp.weight, x.dtype), gp, mask_g)
        mask_u = draw_mask(x.shape, upp.lora_A, upp.dropout_p, x.device)  # (N, d)
        up, xa_u = project_forward(lin_fwd, x, materialize(upp.weight, x.dtype), upp, mask_u)
        h = act_fwd(gate, up)  # (N, I); transient
        mask_d = draw_mask(h.shape, dp.lora_A, dp.dropout_p, x.device)  # (N, I)
        y, xa_d = project_forward(lin_fwd, h, materialize(dp.weight, x.dtype), dp, mask_d)
        del h
        # Quantized weights are objects, not tensors: keep them on ctx and dequantize again later.
        ctx.params = [
            p._replace(
                weight=p.weight if is_quantized(p.weight) else None,
                bias=None,
                lora_A=None,
                lora_B=None,
            )
            for p in params
        ]
        dense = [None if is_quantized(p.weight) else p.weight for p in params]
        ctx.save_for_backward(
            x, gate, up, *dense, *(p.lora_A for p in params), *(p.lora_B for p in params),
            xa_g, xa_u, xa_d, mask_g, mask_u, mask_d,
        )  # fmt: skip
        ctx.backends = (lin_backend, act_backend)
        return y

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        x, gate, up = saved[:3]
        dense, As, Bs, xas, masks = saved[3:6], saved[6:9], saved[9:12], saved[12:15], saved[15:18]
        params = [
            p._replace(
                weight=materialize(p.weight, x.dtype) if w is None else w, lora_A=a, lora_B=b
            )
            for p, w, a, b in zip(ctx.params, dense, As, Bs)
        ]
        need = ctx.needs_input_grad
        # Per projection (dx-or-input, dA, dB, db); input index 1 + 4i + (0 W, 1 b, 2 A, 3 B).
        wants = [(need[3 + 4 * i], need[4 + 4 * i], need[2 + 4 * i]) for i in range(3)]
        _, lin_bwd = _lin._implementation(ctx.backends[0])
        act_fwd, act_bwd = _act._implementation(ctx.backends[1])
        g = g.contiguous()
        gp, upp, dp = params
        need_dh = need[0] or any(any(w) for w in wants[:2])
        h = act_fwd(gate, up)  # (N, I) recomputed instead of saved
        dh, dA_d, dB_d, db_d = project_backward(
            lin_bwd, g, h, dp.weight, dp, xas[2], masks[2], (need_dh, *wants[2])
        )
        del h
        out = [None] * 13
        out[9:13] = [None, db_d, dA_d, dB_d]
        if need_dh:
            dgate, dup = act_bwd(dh, gate, up)  # (N, I) each
            del dh
            dx_g, dA_g, dB_g, db_g = project_backward(
                lin_bwd, dgate, x, gp.weight, gp, xas[0], masks[0], (need[0], *wants[0])
            )
            dx_u, dA_u, dB_u, db_u = project_backward(
                lin_bwd, dup, x, upp.weight, upp, xas[1], masks[1], (need[0], *wants[1])
            )
            out[1:9] = [None, db_g, dA_g, dB_g, None, db_u, dA_u, dB_u]
            if need[0]:
                out[0] = dx_g.add_(dx_u)
        return (*out, None, None, None)


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
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` over any leading shape of ``x`` (..., d) -> (..., d)."""
    _check(x, gate, up, down)
    lin_backend = backends.select("lora_linear", x.device, backend)
    act_backend = backends.select("swiglu", x.device, backend)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()  # (N, d)
    params = [p if training else p._replace(dropout_p=0.0) for p in (gate, up, down)]
    meta = tuple((float(p.scaling), float(p.dropout_p)) for p in params)
    flat = [t for p in params for t in (p.weight, p.bias, p.lora_A, p.lora_B)]
    y = LoRAMLPFunction.apply(x2, *flat, meta, lin_backend, act_backend)
    return y.reshape(*x.shape[:-1], d)
