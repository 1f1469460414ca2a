"""The torch body of :mod:`lorafuse.ops.moe_lora`: routing, the expert activations and the grouped
forward / backward that ``csrc/moe_lora.cpp`` implements too (same contract, same arguments).

It lives apart from the op so the op's file stays its policy, reference, ``autograd.Function``,
checks and entry point; it never imports the op.

Shapes: T tokens, H hidden, K experts per token, S = T*K routed pairs, E experts, I the expert
width; a projection stack (:class:`ExpertStack`) holds W (E, out, in) — or (E, in, out) with
``transposed`` (gpt-oss) — a bias (E, out) or None, and LoRA A (E, r, in), B (E, out, r).

Routing (:func:`route`): the S pairs sorted once by expert (stable, so ties keep token order),
``counts`` (E,) pairs per expert: expert e owns the contiguous slice ``offsets[e]:offsets[e+1]``
of the sorted pairs. ``tok`` (S,) is the token row of each sorted pair, ``ws`` (S,) its router
weight. Experts with no pair are never visited (no product, zero LoRA gradients).

Per non-empty group (n rows): ``gu = x_e·W_guᵀ (+ b) + s·(x_e·Aᵀ)·Bᵀ`` (n, 2I), ``h = act(gu)``
(n, I) in fp32 rounded once, ``y = h·W_dᵀ (+ b) + s·(h·Aᵀ)·Bᵀ`` (n, H), accumulated as
``out[tok] += ws·y`` in fp32. The rank-r products run in fp32 (PEFT keeps expert adapters in fp32).

Backward takes ``gu`` as forward saved it (S·2I values in x's dtype and the rank-r ``x·Aᵀ``:
a small fraction of what stock keeps, and one weight pass less than recomputing it; recomputed
from x where not saved) and recomputes ``h``, then
``u = g_e·W_d,eff`` (n, I) gives both the router-weight gradient ``dws = Σ h·u (+ g·b_d)`` and
``dh = ws·u``; the activation's backward gives ``dgu`` and ``dx_e = dgu·W_gu,eff``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

F32 = torch.float32


def acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype the elementwise math, rank-r products and sums run in: fp32, fp64 for fp64
    inputs (the gradcheck)."""
    return torch.promote_types(dtype, F32)


class ExpertStack(NamedTuple):
    """One projection of every expert: base W (+ bias) and an optional LoRA adapter."""

    weight: object  # (E, out, in) Tensor, or (E, in, out) with ``transposed``; or NF4 experts
    bias: torch.Tensor | None  # (E, out)
    lora_A: torch.Tensor | None  # (E, r, in)
    lora_B: torch.Tensor | None  # (E, out, r)
    scaling: float
    transposed: bool = False


class Activation(NamedTuple):
    """How ``gu`` (n, 2I) becomes ``h`` (n, I): ``swiglu`` = silu(gate)·up; ``clamped_swiglu``
    (gpt-oss) = (clamp(up, ±limit) + 1)·g·sigmoid(alpha·g), g = clamp(gate, max=limit).
    ``interleaved``: gate/up are columns 0::2 / 1::2 (gpt-oss), else the two halves."""

    kind: str = "swiglu"
    interleaved: bool = False
    alpha: float = 1.702
    limit: float = 7.0


def route(top_k_index: torch.Tensor, n_experts: int):
    """``(order (S,), counts (E,))``: the routed pairs sorted by expert (stable: ties keep token
    order) and the number of pairs per expert (int64, on the CPU for the group loop)."""
    flat = top_k_index.reshape(-1)  # (S,)
    order = torch.argsort(flat, stable=True)  # (S,)
    counts = torch.bincount(flat, minlength=n_experts)  # (E,) or longer on a bad index
    if counts.numel() != n_experts or (flat.numel() and int(flat.min()) < 0):
        raise ValueError(
            f"moe_lora: expert indices must lie in [0, {n_experts}), got "
            f"[{int(flat.min())}, {int(flat.max())}]"
        )
    return order, counts.cpu()


def expert_weight(weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s base weight in its storage layout: a view, or a transient dequantised copy
    (an NF4 expert stack: ``weight.expert(e).dequantize(dtype)``)."""
    if isinstance(weight, torch.Tensor):
        return weight[e]
    return weight.expert(e).dequantize(dtype)


def _base(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ w if transposed else x @ w.T  # (n, out)


def _base_t(g: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return g @ w.T if transposed else g @ w  # (n, in): g · W_e


def project(x_e, p: ExpertStack, e: int):
    """``(y (n, out) in x's dtype, xa (n, r) fp32 or None)`` of expert ``e``."""
    y = _base(x_e, expert_weight(p.weight, e, x_e.dtype), p.transposed)
    if p.bias is not None:
        y = y + p.bias[e]
    if p.lora_A is None:
        return y, None
    f = acc(x_e.dtype)
    xa = x_e.to(f) @ p.lora_A[e].to(f).T  # (n, r)
    return (y.to(f) + p.scaling * (xa @ p.lora_B[e].to(f).T)).to(x_e.dtype), xa


def _halves(gu: torch.Tensor, act: Activation):
    if act.interleaved:
        return gu[:, 0::2], gu[:, 1::2]
    i = gu.shape[1] // 2
    return gu[:, :i], gu[:, i:]


def activate(gu: torch.Tensor, act: Activation) -> torch.Tensor:
    """``h`` (n, I) in gu's dtype, computed in fp32 and rounded once."""
    gate, up = (t.to(acc(gu.dtype)) for t in _halves(gu, act))
    if act.kind == "swiglu":
        return (torch.nn.functional.silu(gate) * up).to(gu.dtype)
    g = gate.clamp(max=act.limit)
    u = up.clamp(-act.limit, act.limit)
    return ((u + 1) * g * torch.sigmoid(g * act.alpha)).to(gu.dtype)


def activate_backward(dh: torch.Tensor, gu: torch.Tensor, act: Activation) -> torch.Tensor:
    """``dgu`` (n, 2I) from ``dh`` (n, I), both in the accumulation dtype; clamp passes gradient where
    ``min <= v <= max`` (torch's rule)."""
    gate, up = (t.to(dh.dtype) for t in _halves(gu, act))
    dgu = torch.empty(gu.shape, dtype=dh.dtype, device=gu.device)
    dgate, dup = _halves(dgu, act)
    if act.kind == "swiglu":
        s = torch.sigmoid(gate)
        dup.copy_(dh * gate * s)
        dgate.copy_(dh * up * s * (1 + gate * (1 - s)))
        return dgu
    g = gate.clamp(max=act.limit)
    u = up.clamp(-act.limit, act.limit)
    s = torch.sigmoid(g * act.alpha)
    glu = g * s
    dup.copy_(torch.where(up.abs() <= act.limit, dh * glu, 0.0))
    dglu = dh * (u + 1) * (s + act.alpha * glu * (1 - s))
    dgate.copy_(torch.where(gate <= act.limit, dglu, 0.0))
    return dgu


def groups(counts: torch.Tensor):
    """``(e, start, stop)`` of every expert that received pairs (the torch body's loop; the C++
    kernel walks the same non-empty groups in C++)."""
    stops = torch.cumsum(counts, 0).tolist()
    start = 0
    for e, stop in enumerate(stops):
        if stop > start:
            yield e, start, stop
        start = stop


def forward(x, tok, ws, counts, gu: ExpertStack, down: ExpertStack, act: Activation,
            save: bool = False):  # fmt: skip
    """``(out (T, H) in x's dtype, saved)``: Σ over each token's pairs of ``ws · expert(x)``;
    ``save``: ``saved = (z (S, 2I) the gate/up products in x's dtype, xa (S, r) their rank-r
    products or None)`` in sorted pair order, for backward; else ``(None, None)``."""
    f = acc(x.dtype)
    out = torch.zeros(x.shape, dtype=f, device=x.device)  # (T, H) fp32 accumulator
    width = gu.weight.shape[2] if gu.transposed else gu.weight.shape[1]
    z_all = x.new_empty((tok.numel(), width)) if save else None  # (S, 2I)
    xa_all = None
    if save and gu.lora_A is not None:
        xa_all = torch.empty((tok.numel(), gu.lora_A.shape[1]), dtype=f, device=x.device)
    for e, a, b in groups(counts):
        x_e = x.index_select(0, tok[a:b])  # (n, H)
        z, xa = project(x_e, gu, e)  # (n, 2I), (n, r)
        if z_all is not None:
            z_all[a:b] = z
        if xa_all is not None:
            xa_all[a:b] = xa
        y, _ = project(activate(z, act), down, e)  # (n, H)
        out.index_add_(0, tok[a:b], y.to(f) * ws[a:b, None].to(f))
    return out.to(x.dtype), (z_all, xa_all)


def _lora_grads(p: ExpertStack, need: bool):
    if p.lora_A is None or not need:
        return None, None
    return torch.zeros_like(p.lora_A), torch.zeros_like(p.lora_B)


def backward(g, x, tok, ws, counts, gu: ExpertStack, down: ExpertStack, act: Activation,
             need_x: bool, need_ws: bool, need_lora: bool, saved=(None, None)):  # fmt: skip
    """``(dx (T, H), dws (S,) fp32, dA_gu, dB_gu, dA_d, dB_d)``; None where not needed.
    ``saved``: :func:`forward`'s ``(z, xa)``; where None, recomputed per group from x."""
    f = acc(x.dtype)
    dx = torch.zeros(x.shape, dtype=f, device=x.device) if need_x else None  # (T, H)
    dws = torch.zeros(tok.shape, dtype=f, device=x.device) if need_ws else None  # (S,)
    dA_gu, dB_gu = _lora_grads(gu, need_lora)
    dA_d, dB_d = _lora_grads(down, need_lora)
    for e, a, b in groups(counts):
        x_e, g_e = x.index_select(0, tok[a:b]), g.index_select(0, tok[a:b])  # (n, H)
        if saved[0] is not None:
            z, xa = saved[0][a:b], (None if saved[1] is None else saved[1][a:b])
        else:
            z, xa = project(x_e, gu, e)  # (n, 2I), recomputed
        h = activate(z, act)  # (n, I)
        # u = g_e·W_d in fp32 sums, unrounded: it gives dh and the router weight's gradient
        u = _base_t(g_e.to(f), expert_weight(down.weight, e, g.dtype).to(f), down.transposed)
        g32, w_col = g_e.to(f), ws[a:b, None].to(f)  # (n, H), (n, 1)
        if down.lora_A is not None:
            gb = g32 @ down.lora_B[e].to(f)  # (n, r)
            u = u + down.scaling * (gb @ down.lora_A[e].to(f))  # (n, I)
            if dA_d is not None:
                ha = h.to(f) @ down.lora_A[e].to(f).T  # (n, r)
                dB_d[e] = (down.scaling * (w_col * g32).T @ ha).to(dB_d.dtype)  # (H, r)
                dA_d[e] = ((down.scaling * w_col * gb).T @ h.to(f)).to(dA_d.dtype)  # (r, I)
        if dws is not None:
            dw = (h.to(f) * u).sum(1)  # (n,)
            if down.bias is not None:
                dw = dw + g32 @ down.bias[e].to(f)
            dws[a:b] = dw
        if dx is None and dA_gu is None:
            continue
        dz = activate_backward(w_col * u, z, act)  # (n, 2I) fp32
        gbz = None if gu.lora_A is None else gu.scaling * (dz @ gu.lora_B[e].to(f))  # (n, r)
        if dA_gu is not None:
            dB_gu[e] = (gu.scaling * dz.T @ xa).to(dB_gu.dtype)  # (2I, r)
            dA_gu[e] = (gbz.T @ x_e.to(f)).to(dA_gu.dtype)  # (r, H)
        if dx is not None:
            w_gu = expert_weight(gu.weight, e, x.dtype)
            dx_e = _base_t(dz.to(x.dtype), w_gu, gu.transposed).to(f)  # (n, H)
            if gbz is not None:
                dx_e = dx_e + gbz @ gu.lora_A[e].to(f)
            dx.index_add_(0, tok[a:b], dx_e)
    return (dx.to(x.dtype) if dx is not None else None), dws, dA_gu, dB_gu, dA_d, dB_d
