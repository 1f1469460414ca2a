"""One projection of a fused block (Q/K/V or gate/up/down) as the fused ops take it.

:class:`~lorafuse.ops.lora_params.LoRAParams` bundles a base linear layer and
its optional LoRA adapter. The helpers here run one projection forward/backward through a
backend's ``lora_linear`` kernels, through the split path of :mod:`lorafuse.ops.lora_split`
(frozen and LoRA products apart) for a quantized weight walked in tiles, or as a plain frozen
linear when the projection carries no adapter, so :mod:`lorafuse.ops.lora_mlp` and
:mod:`lorafuse.ops.lora_qkv` share one code path per projection. They also share how three
projections travel through an ``autograd.Function`` (:func:`flatten` / :func:`unflatten` and the
gradients back, :func:`input_needs` / :func:`input_grads`), what is saved for backward
(:func:`save_groups` / :func:`saved_groups`: named groups, no index arithmetic), the casts
autocast asks for (:func:`cast_params`) and when projections sharing their input run their
rank-r A products stacked (:func:`stackable`).

Shapes: x (N, d), weight (k, d) dense or quantized (see :mod:`lorafuse.ops.weights`), bias (k,),
lora_A (r, d), lora_B (k, r).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from lorafuse.ops import autocast
from lorafuse.ops import lora_linear as _lin
from lorafuse.ops.lora_linear import via_custom_op as lora_linear_via_custom_op
from lorafuse.ops.lora_params import LoRAParams
from lorafuse.ops.lora_split import split_backward, split_forward
from lorafuse.ops.weights import is_quantized, materialize, tiled

# The autograd inputs per projection, after x: (weight, bias, lora_A, lora_B).
_PER_PROJECTION = 4


def draw_mask(shape, lora_A: torch.Tensor | None, p: float, device) -> torch.Tensor | None:
    """A dropout keep-mask drawn exactly as ``nn.Dropout`` draws it on the adapter-dtype input.

    Returns None when there is no adapter or no dropout, i.e. when PEFT would draw nothing
    (``lora_dropout=0`` is an ``nn.Identity``), so the RNG stream stays in step with stock PEFT.
    """
    if lora_A is None or p <= 0.0:
        return None
    return torch.empty(shape, dtype=lora_A.dtype, device=device).bernoulli_(1.0 - p).bool()


def _split(x, p: LoRAParams) -> bool:
    """Whether projection ``p`` runs split (:mod:`lorafuse.ops.lora_split`): a quantized weight
    walked in tiles, never one dense copy of it (:func:`~lorafuse.ops.weights.tiled`)."""
    return tiled(p.weight, x.dtype)


def project_forward(x, p: LoRAParams, mask, backend: str):
    """One projection forward: ``(y (N, k) in x's dtype, xa (N, r) or None)``."""
    if _split(x, p):
        (y,), (xa,) = split_forward(x, [p], [mask], backend=backend)
        return y, xa
    dense = materialize(p.weight, x.dtype)  # (k, d); transient if quantized
    if not p.has_lora:
        return F.linear(x, dense, p.bias), None
    fwd, _ = _lin.implementation(backend)
    keep = 1.0 - p.dropout_p if mask is not None else 1.0
    return fwd(x, dense, p.bias, p.lora_A, p.lora_B, float(p.scaling), mask, keep)


def project_custom_op(x, p: LoRAParams, backend: str) -> torch.Tensor:
    """One projection under torch.compile: the ``lorafuse::lora_linear`` custom op (its own
    dropout draw first, as :func:`draw_mask`), or a plain frozen linear; (N, k) in x's dtype."""
    if not p.has_lora:
        return F.linear(x, materialize(p.weight, x.dtype), p.bias)
    return lora_linear_via_custom_op(
        x, p.weight, p.bias, p.lora_A, p.lora_B, p.scaling, p.dropout_p, backend
    )


def project_backward(g, x, p: LoRAParams, xa, mask, needs, backend: str):
    """One projection backward: ``(dx, dA, dB, db)``, each None unless asked for in ``needs``.

    ``needs`` = (need_dx, need_dA, need_dB, need_db), the lora_linear contract order.
    """
    need_dx, need_dA, need_dB, need_db = needs
    if not any(needs):
        return None, None, None, None
    if _split(x, p):
        dx, ((db, dA, dB),) = split_backward(
            [g], x, [p], [xa], need_dx, [(need_dA, need_dB, need_db)], [mask], backend=backend
        )
        return dx, dA, dB, db
    dense = materialize(p.weight, x.dtype)  # (k, d); transient if quantized
    if not p.has_lora:
        dx = (g @ dense) if need_dx else None  # (N, d)
        db = g.sum(0, dtype=torch.float32).to(g.dtype) if need_db else None
        return dx, None, None, db
    _, bwd = _lin.implementation(backend)
    keep = 1.0 - p.dropout_p if mask is not None else 1.0
    return bwd(g, x, dense, p.lora_A, p.lora_B, xa, float(p.scaling), mask, keep, tuple(needs))


# ---- Policy: projections that share an input (q/k/v; gate/up) run their rank-r A products
# stacked where stackable() says so (the split path of lora_split.py, whose docstring says what
# that saves; lora_mlp.stack_gate_up narrows it to where it measured faster).


def stackable(params, backend: str) -> bool:
    """Whether :func:`~lorafuse.ops.lora_split.split_forward` / ``split_backward`` serve
    ``params`` (projections of one input) with their A products stacked: at least two adapters,
    one adapter dtype, no dropout (with dropout each projection draws its own mask on x, so
    there is no shared input), a torch or C++ backend (the Triton kernels keep one launch per
    projection; stacking there is not measured)."""
    lora = [p for p in params if p.has_lora]
    return (
        backend in ("torch", "cpp")
        and len(lora) >= 2
        and all(p.dropout_p == 0.0 for p in lora)
        and len({p.lora_A.dtype for p in lora}) == 1
    )


def cast_params(p: LoRAParams, dtype: torch.dtype) -> LoRAParams:
    """``p`` with every tensor cast as autocast casts a linear's operands (see ops/autocast.py)."""
    return p._replace(
        weight=autocast.cast(p.weight, dtype),
        bias=autocast.cast(p.bias, dtype),
        lora_A=autocast.cast(p.lora_A, dtype),
        lora_B=autocast.cast(p.lora_B, dtype),
    )


# --------------------------------------------------------------------------------------------
# Projections through an autograd.Function: apply(x, *flatten(params), meta, ...).


def flatten(params) -> list:
    """The Function's tensor inputs after ``x``: (weight, bias, lora_A, lora_B) per projection."""
    return [t for p in params for t in (p.weight, p.bias, p.lora_A, p.lora_B)]


def meta_of(params) -> tuple:
    """The static part of each projection, passed to the Function next to :func:`flatten`."""
    return tuple((float(p.scaling), float(p.dropout_p)) for p in params)


def unflatten(tensors, meta) -> list[LoRAParams]:
    """Inverse of :func:`flatten` + :func:`meta_of`."""
    n = _PER_PROJECTION
    return [LoRAParams(*tensors[n * i : n * i + n], *m) for i, m in enumerate(meta)]


def input_needs(needs, i: int) -> tuple[bool, bool, bool]:
    """``(need_dA, need_dB, need_db)`` of projection ``i`` from ``ctx.needs_input_grad`` (x first)."""
    _, bias, lora_A, lora_B = needs[1 + _PER_PROJECTION * i : 1 + _PER_PROJECTION * (i + 1)]
    return lora_A, lora_B, bias


def input_grads(grads) -> list:
    """The gradients for :func:`flatten`'s inputs from ``(db, dA, dB)`` per projection
    (frozen weights get None)."""
    return [t for db, dA, dB in grads for t in (None, db, dA, dB)]


# --------------------------------------------------------------------------------------------
# Saved tensors by name.


def save_groups(ctx, **groups) -> None:
    """``ctx.save_for_backward`` of named tensors or sequences of tensors (None allowed)."""
    flat, layout = [], []
    for name, value in groups.items():
        many = isinstance(value, (list, tuple))
        layout.append((name, len(value) if many else None))
        flat.extend(value if many else (value,))
    ctx.save_for_backward(*flat)
    ctx.saved_layout = tuple(layout)


def saved_groups(ctx) -> SimpleNamespace:
    """What :func:`save_groups` saved, by the same names (sequences come back as tuples)."""
    it = iter(ctx.saved_tensors)
    return SimpleNamespace(**{
        name: next(it) if n is None else tuple(next(it) for _ in range(n))
        for name, n in ctx.saved_layout
    })  # fmt: skip


def save_projections(ctx, params, **extra) -> None:
    """Save ``params`` for backward: their adapters and dense weights as tensors, quantized
    weight objects and the static fields on ``ctx`` (only tensors can be saved), plus ``extra``.

    Biases are not saved: backward needs only their gradient, which is ``g.sum(0)``.
    """
    ctx.params = [
        p._replace(weight=p.weight if is_quantized(p.weight) else None, bias=None, lora_A=None,
                   lora_B=None)
        for p in params
    ]  # fmt: skip
    save_groups(
        ctx,
        weight=[None if is_quantized(p.weight) else p.weight for p in params],
        lora_A=[p.lora_A for p in params],
        lora_B=[p.lora_B for p in params],
        **extra,
    )


def saved_projections(ctx) -> tuple[list[LoRAParams], SimpleNamespace]:
    """``(params, saved)``: :func:`save_projections`' params and everything else it saved, by
    name. Quantized weights come back quantized: each backward step dequantizes its own
    projection right before its products (:func:`~lorafuse.ops.weights.materialize` into
    ``saved.x``'s dtype), so at most one dense copy is alive at a time."""
    saved = saved_groups(ctx)
    params = [
        p._replace(weight=p.weight if w is None else w, lora_A=a, lora_B=b)
        for p, w, a, b in zip(ctx.params, saved.weight, saved.lora_A, saved.lora_B)
    ]
    return params, saved
