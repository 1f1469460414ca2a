"""The forward and backward passes of the fused DoRA linear (:mod:`lorafuse.ops.dora`), given
``scale = m/n`` (k,): :func:`dora_forward` ``-> (y, xa, h)`` and :func:`dora_backward` ``-> (dx, db,
dA, dB, ds)``, with the dropout mask they share (:func:`draw_mask`).

Shapes (flattened): x (N, d), W (k, d) dense or quantized, b (k,), A (r, d), B (k, r). The LoRA
projection ``h = xd·Wᵀ + s·(xd·Aᵀ)·Bᵀ`` (N, k) and its backward run on
:mod:`lorafuse.ops.lora_linear`'s kernels of the chosen backend (a large quantized W by tiles,
:mod:`lorafuse.ops.lora_split`); the elementwise steps ``y = (m/n)·h + b`` and ``gm = g·(m/n)``,
``ds = Σ_tokens g·h`` are torch here (:func:`torch_scale_rows`, :func:`torch_grads`, the contract
of ``triton/dora.py``'s ``scale_rows`` and ``grads``) or Triton. The math and what is saved:
:mod:`lorafuse.ops.dora`'s docstring.

Why a file of its own: both paths of the op run these passes (its ``autograd.Function`` in eager,
the ``lorafuse::dora_linear`` / ``dora_linear_backward`` custom ops under ``torch.compile``), and
with the op they would not fit one file. ``ops/dora.py`` keeps the op: its policy block (the
weight norm's rules), the reference, the weight norm, the Function, the checks, the entry point
and the custom ops. It chooses no backend: ``backend`` comes in as an argument.
"""

from __future__ import annotations

import torch

from lorafuse import backends
from lorafuse.ops import lora_linear as _lin
from lorafuse.ops.lora_params import LoRAParams
from lorafuse.ops.lora_rank import masked
from lorafuse.ops.lora_split import split_backward, split_forward
from lorafuse.ops.weights import frozen_input_grad, frozen_linear, materialize, tiled


def torch_scale_rows(h, scale, bias):
    """``y = (m/n)·h + b`` (N, k) in h's dtype, computed in scale's dtype."""
    y = h.to(scale.dtype) * scale
    if bias is not None:
        y += bias.to(y.dtype)
    return y.to(h.dtype)


def torch_grads(g, h, scale, need_ds):
    """``(gm, ds)``: gm = g·(m/n) (N, k) in g's dtype; ds = Σ_tokens g·h (k,) in scale's dtype,
    the gradient of ``m/n`` (None unless ``need_ds``)."""
    gc = g.to(scale.dtype)
    gm = (gc * scale).to(g.dtype)
    ds = (gc * h.to(gc.dtype)).sum(0) if need_ds else None
    return gm, ds


def _elementwise(backend: str):
    if backend == "triton":
        return backends.compiled("dora_linear", "triton", "scale_rows", "grads")
    return torch_scale_rows, torch_grads


def _project(xd, weight, lora_A, lora_B, scaling, backend):
    """``(h, xa)``: h = xd·Wᵀ + s·xa·Bᵀ (N, k) in xd's dtype, xa = xd·Aᵀ (N, r)."""
    if tiled(weight, xd.dtype):  # a quantized W by tiles, never whole
        (h,), (xa,) = split_forward(xd, [LoRAParams(weight, None, lora_A, lora_B, scaling)],
                                    backend=backend)  # fmt: skip
        return h, xa
    fwd, _ = _lin.implementation(backend)
    return fwd(xd, materialize(weight, xd.dtype), None, lora_A, lora_B, scaling, None, 1.0)


def _project_backward(gm, xd, weight, lora_A, lora_B, xa, scaling, needs, backend):
    """``(dxd, dA, dB)`` of :func:`_project` at output gradient ``gm`` (None where not asked)."""
    need_dx, need_dA, need_dB = needs
    if tiled(weight, xd.dtype):
        p = LoRAParams(weight, None, lora_A, lora_B, scaling)
        dx, ((_, dA, dB),) = split_backward(
            [gm], xd, [p], [xa], need_dx, [(need_dA, need_dB, False)], backend=backend
        )
        return dx, dA, dB
    _, bwd = _lin.implementation(backend)
    w = materialize(weight, xd.dtype)
    dx, dA, dB, _ = bwd(gm, xd, w, lora_A, lora_B, xa, scaling, None, 1.0, (*needs, False))
    return dx, dA, dB


def _dropped_input(x, lora_A, mask, keep):
    """dropout(x) (N, d) in x's dtype, drawn as the LoRA branch sees it (adapter dtype)."""
    return x if mask is None else masked(x.to(lora_A.dtype), mask, keep).to(x.dtype)


def draw_mask(x, lora_A, dropout_p):
    """The dropout keep-mask (N, d) bool or None: nn.Dropout's draw on the adapter-dtype input."""
    if dropout_p == 0.0:
        return None
    return (
        torch.empty(x.shape, dtype=lora_A.dtype, device=x.device).bernoulli_(1.0 - dropout_p).bool()
    )


def dora_forward(x, weight, bias, lora_A, lora_B, scale, scaling, mask, keep, backend):
    """``(y, xa, h)`` for ``scale = m/n`` (k,): y (N, k) and h (N, k) in x's dtype, xa (N, r).
    The math of :class:`DoRALinearFunction` and of the ``lorafuse::dora_linear`` custom op."""
    xd = _dropped_input(x, lora_A, mask, keep)  # (N, d)
    h, xa = _project(xd, weight, lora_A, lora_B, scaling, backend)  # (N, k), (N, r)
    scale_rows, _ = _elementwise(backend)
    y = scale_rows(h, scale, bias)  # (N, k)
    if mask is not None:  # + (x - xd)·Wᵀ: the undropped base output PEFT adds
        y += frozen_linear(x - xd, weight, None, x.dtype)
    return y, xa, h


def dora_backward(g, x, weight, lora_A, lora_B, xa, mask, h, scale, scaling, keep, needs, backend):
    """``(dx, db, dA, dB, ds)`` of :func:`dora_forward`, ``ds`` the gradient of ``scale`` (k,);
    each None unless asked for in ``needs`` (same order)."""
    need_dx, need_db, need_dA, need_dB, need_ds = needs
    g = g.contiguous()
    _, grads = _elementwise(backend)
    gm, ds = grads(g, h, scale, need_ds)  # (N, k), (k,)
    xd = _dropped_input(x, lora_A, mask, keep)
    dx, dA, dB = _project_backward(
        gm, xd, weight, lora_A, lora_B, xa, scaling, (need_dx, need_dA, need_dB), backend
    )
    if need_dx and mask is not None:  # dx = g·W + D∘(dh/dxd - g·W)
        gw = frozen_input_grad(g, weight, x.dtype)  # (N, d)
        dx = gw.add_(masked((dx - gw).to(lora_A.dtype), mask, keep).to(x.dtype))
    db = g.sum(0, dtype=torch.float32).to(g.dtype) if need_db else None
    return dx, db, dA, dB, ds
