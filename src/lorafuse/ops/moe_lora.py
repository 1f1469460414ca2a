"""Fused mixture-of-experts LoRA: the routed experts' gate/up and down projections, each base +
LoRA, the activation and the router weights in one op, forward and backward.

    out[t] = Σ_k  w[t,k] · down_e( act( gate_up_e(x[t]) ) ),   e = top_k_index[t, k]
    proj_e(v) = v·W_eᵀ (+ b_e) + s·(v·A_eᵀ)·B_eᵀ          (per expert, PEFT's ParamWrapper LoRA)

Shapes: x (T, H); top_k_index / top_k_weights (T, K); gate_up W (E, 2I, H) — (E, H, 2I) with
``transposed`` (gpt-oss) — A (E, r, H), B (E, 2I, r); down W (E, H, I) or (E, I, H), A (E, r, I),
B (E, H, r); biases (E, out) or None; out (T, H). PEFT stores expert adapters as ``lora_A.weight``
(E·r, in) and ``lora_B.weight`` (out, r·E): ``A = a.view(E, r, in)``, ``B = b.view(out, r, E)
.permute(2, 0, 1)`` (:func:`peft_factors`).

* Fused: the T·K routed pairs are sorted once by expert (stable, so top-k ties keep token
  order); each expert's pairs are one contiguous slice, multiplied by its base weight and its
  rank-r factors (the dense ``W + s·B·A`` stock PEFT materialises for every expert on every
  forward is never formed), the activation (SwiGLU, or gpt-oss's clamped one) is one fp32 pass,
  and the router weights are applied while the rows are summed back per token (in fp32). Experts
  that receive no token are never visited: no product, zero LoRA gradient.
* Saved for backward: x, the sort (order, per-expert counts), the router weights and the gate/up
  products (T·K, 2I) in x's dtype with their rank-r ``x·Aᵀ`` (recomputing them costs a pass over
  every expert's gate/up weight); the activation is recomputed per group in backward. Under
  ``torch.compile`` (the custom op) nothing per pair is saved: backward recomputes the products. Frozen base weights get no gradient and are never copied; NF4
  expert stacks are dequantised one expert at a time, in forward and again in backward.
* Backward gives dx, the router weights' gradient (routing logits get gradients in stock too:
  ``Σ_h y·g`` per pair), and every expert's LoRA dA / dB.

Backends (:mod:`lorafuse.backends`, op ``moe_lora``): ``torch`` (:mod:`.moe_lora_groups`: the
group loop in Python over the non-empty experts), ``cpp`` (``csrc/moe_lora.cpp``: the same
contract, its group loop in C++, the activation and the weighted scatter fused) and ``triton``
(``triton/moe_lora.py``: the same contract as grouped GEMMs over (expert, row-tile) programs, the
activation in the gate/up epilogue; dense expert weights only: NF4 stacks run torch, warned). Under
``torch.compile`` (end of file) ``lorafuse::moe_lora`` is one graph node.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import custom_ops
from lorafuse.ops import moe_lora_groups as groups
from lorafuse.ops.moe_lora_groups import Activation, ExpertStack
from lorafuse.ops.weights import is_quantized

__all__ = ["Activation", "ExpertStack", "moe_lora", "moe_lora_reference", "peft_factors"]

# ---- Policy ---------------------------------------------------------------------------------
ACTIVATIONS = ("swiglu", "clamped_swiglu")
SWIGLU = Activation("swiglu")  # Qwen3-MoE, Qwen3.5-MoE / Qwen3-Next, LFM2-MoE, Granite 4
# The C++ kernel's activation codes (csrc/moe_lora.cpp: kSwiglu, kClampedSwiglu).
_ACT_CODE = {"swiglu": 0, "clamped_swiglu": 1}


def peft_factors(lora_A: Tensor, lora_B: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """PEFT ParamWrapper weights ``lora_A`` (E·r, in), ``lora_B`` (out, r·E) as ``A (E, r, in)``
    and ``B (E, out, r)`` views (PEFT's own ``get_delta_factors`` reshape; B is not contiguous)."""
    A = lora_A.view(n_experts, -1, lora_A.shape[-1])  # (E, r, in)
    B = lora_B.view(lora_B.shape[0], -1, n_experts).permute(2, 0, 1)  # (E, out, r)
    return A, B


# --------------------------------------------------------------------------------------------
# The reference: what transformers' expert loop computes on PEFT's parametrised weights.


def _effective(p: ExpertStack, dtype) -> Tensor:
    w = torch.stack([groups.expert_weight(p.weight, e, dtype) for e in range(p.weight.shape[0])])
    if p.lora_A is None:
        return w
    delta = p.lora_B @ p.lora_A  # (E, out, in)
    return w + p.scaling * (delta.transpose(1, 2) if p.transposed else delta).to(w.dtype)


def _reference_act(gu: Tensor, act: Activation) -> Tensor:
    if act.kind == "swiglu":
        gate, up = (gu[..., ::2], gu[..., 1::2]) if act.interleaved else gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    gate, up = (gu[..., ::2], gu[..., 1::2]) if act.interleaved else gu.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def moe_lora_reference(x, top_k_index, top_k_weights, gate_up: ExpertStack, down: ExpertStack,
                       act: Activation = SWIGLU) -> Tensor:  # fmt: skip
    """Plain autograd math, as ``Qwen3MoeExperts`` / ``GptOssExperts`` run under PEFT's
    ``ParamWrapper`` (dense ``W + s·B·A`` per expert, the loop over hit experts): the oracle."""
    w_gu, w_d = _effective(gate_up, x.dtype), _effective(down, x.dtype)
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(top_k_index, w_gu.shape[0]).permute(2, 1, 0)  # (E, K, T)
    for e in range(w_gu.shape[0]):
        pos, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        gu = x[tok] @ (w_gu[e] if gate_up.transposed else w_gu[e].T)
        if gate_up.bias is not None:
            gu = gu + gate_up.bias[e]
        y = _reference_act(gu, act) @ (w_d[e] if down.transposed else w_d[e].T)
        if down.bias is not None:
            y = y + down.bias[e]
        out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
    return out


# --------------------------------------------------------------------------------------------
# The autograd Function.


def _stack_args(p: ExpertStack) -> list:
    return [p.weight, p.bias, p.lora_A, p.lora_B, float(p.scaling), bool(p.transposed)]


def _cpp_weight(w):
    """The C++ kernel's view of a base weight stack: the dense tensor, or the NF4 buffers."""
    if is_quantized(w):
        return None, list(w.buffers())
    return w, []


def implementation(backend: str):
    """``(forward, backward)`` with the contract of :func:`.moe_lora_groups.forward` /
    :func:`.moe_lora_groups.backward`."""
    if backend == "torch":
        return groups.forward, groups.backward
    if backend == "triton":  # triton/moe_lora.py: the torch body's contract, on GPU tensors
        return backends.compiled("moe_lora", "triton", "forward", "backward")
    fwd, bwd = backends.compiled("moe_lora", backend, "forward", "backward")

    def unpack(p: ExpertStack) -> list:
        w, nf4 = _cpp_weight(p.weight)
        shape = list(p.weight.shape)
        return [w, nf4, shape, p.bias, p.lora_A, p.lora_B, float(p.scaling), bool(p.transposed)]

    def forward(x, tok, ws, counts, gu, down, act, save=False):
        out, z, xa = fwd(x.contiguous(), tok, ws, counts, *unpack(gu), *unpack(down),
                         _ACT_CODE[act.kind], act.interleaved, act.alpha, act.limit, save)  # fmt: skip
        return out, (z, xa)

    def backward(g, x, tok, ws, counts, gu, down, act, need_x, need_ws, need_lora,
                 saved=(None, None)):  # fmt: skip
        out = bwd(g, x.contiguous(), tok, ws, counts, *unpack(gu), *unpack(down),
                  _ACT_CODE[act.kind], act.interleaved, act.alpha, act.limit, need_x, need_ws,
                  need_lora, *saved)  # fmt: skip
        return tuple(t if t is not None and t.numel() else None for t in out)

    return forward, backward


class MoELoRAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, w_gu, b_gu, a_gu, bb_gu, s_gu, t_gu,
                w_d, b_d, a_d, bb_d, s_d, t_d, act, backend):  # fmt: skip
        gu = ExpertStack(w_gu, b_gu, a_gu, bb_gu, s_gu, t_gu)
        down = ExpertStack(w_d, b_d, a_d, bb_d, s_d, t_d)
        order, counts = groups.route(top_k_index, w_gu.shape[0])
        tok = torch.div(order, top_k_index.shape[1], rounding_mode="floor")  # (S,)
        ws = top_k_weights.reshape(-1).index_select(0, order)  # (S,)
        fwd, _ = implementation(backend)
        out, (z, xa) = fwd(x, tok, ws, counts, gu, down, act, any(ctx.needs_input_grad))
        ctx.save_for_backward(x, order, tok, ws, counts, z, xa)
        ctx.stacks, ctx.act, ctx.backend = (gu, down), act, backend
        ctx.weights_shape = top_k_weights.shape
        return out

    @staticmethod
    def backward(ctx, g):
        x, order, tok, ws, counts, z, xa = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_lora = any(need[i] for i in (5, 6, 11, 12))
        _, bwd = implementation(ctx.backend)
        gu, down = ctx.stacks
        dx, dws, da_gu, db_gu, da_d, db_d = bwd(
            g.contiguous(),
            x,
            tok,
            ws,
            counts,
            gu,
            down,
            ctx.act,
            need[0],
            need[2],
            need_lora,
            (z, xa),
        )
        dw = None
        if dws is not None:
            dw = torch.empty(order.shape, dtype=dws.dtype, device=dws.device)
            dw[order] = dws
            dw = dw.view(ctx.weights_shape).to(ws.dtype)  # (T, K)
        return (dx, None, dw, None, None, da_gu if need[5] else None,
                db_gu if need[6] else None, None, None, None, None,
                da_d if need[11] else None, db_d if need[12] else None, None, None, None, None)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Checks and the entry point.


def _check_stack(p: ExpertStack, name: str, n_in: int, dtype) -> int:
    if len(p.weight.shape) != 3:
        raise ValueError(
            f"moe_lora: {name} weight must be (E, out, in), got {tuple(p.weight.shape)}"
        )
    e, a, b = p.weight.shape
    out_dim, in_dim = (b, a) if p.transposed else (a, b)
    if in_dim != n_in:
        raise ValueError(f"moe_lora: {name} weight {tuple(p.weight.shape)} (transposed="
                         f"{p.transposed}) takes {in_dim} inputs, got {n_in}")  # fmt: skip
    if isinstance(p.weight, Tensor) and p.weight.requires_grad:
        raise ValueError(f"moe_lora: {name} base weight is trainable; the op gives frozen "
                         "weights no gradient (freeze it or run the model's own forward)")  # fmt: skip
    if p.bias is not None and tuple(p.bias.shape) != (e, out_dim):
        raise ValueError(f"moe_lora: {name} bias {tuple(p.bias.shape)} != ({e}, {out_dim})")
    if (p.lora_A is None) != (p.lora_B is None):
        raise ValueError(f"moe_lora: {name} needs both LoRA factors or neither")
    if p.lora_A is not None:
        r = p.lora_A.shape[1]
        if tuple(p.lora_A.shape) != (e, r, in_dim) or tuple(p.lora_B.shape) != (e, out_dim, r):
            raise ValueError(
                f"moe_lora: {name} LoRA A {tuple(p.lora_A.shape)} / B {tuple(p.lora_B.shape)} do "
                f"not fit ({e}, r, {in_dim}) / ({e}, {out_dim}, r)"
            )
    if isinstance(p.weight, Tensor) and p.weight.dtype != dtype:
        raise ValueError(f"moe_lora: {name} weight is {p.weight.dtype}, x is {dtype}")
    return out_dim


def check_moe_lora(x, top_k_index, top_k_weights, gate_up, down, act) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(
            f"moe_lora: x must be a float (T, H) tensor, got {tuple(x.shape)} {x.dtype}"
        )
    if top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2:
        raise ValueError(f"moe_lora: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must be the same (T, K)")  # fmt: skip
    if top_k_index.shape[0] != x.shape[0] or top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"moe_lora: top_k_index must be integer (T={x.shape[0]}, K), got "
                         f"{tuple(top_k_index.shape)} {top_k_index.dtype}")  # fmt: skip
    if act.kind not in ACTIVATIONS:
        raise ValueError(f"moe_lora: activation {act.kind!r} is not one of {ACTIVATIONS}")
    width = _check_stack(gate_up, "gate_up", x.shape[1], x.dtype)
    if width % 2:
        raise ValueError(f"moe_lora: gate_up has {width} outputs, not a gate/up pair")
    if _check_stack(down, "down", width // 2, x.dtype) != x.shape[1]:
        raise ValueError(f"moe_lora: down gives {down.weight.shape} outputs, x has {x.shape[1]}")
    if gate_up.weight.shape[0] != down.weight.shape[0]:
        raise ValueError("moe_lora: gate_up and down hold different numbers of experts")


def moe_lora(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: ExpertStack,
             down: ExpertStack, act: Activation = SWIGLU,
             backend: str | None = None) -> Tensor:  # fmt: skip
    """The routed experts' output (T, H) in x's dtype (module docstring); gradients for x, the
    router weights and every LoRA factor."""
    check_moe_lora(x, top_k_index, top_k_weights, gate_up, down, act)
    chosen = backends.select("moe_lora", x.device, backend)
    quantized = is_quantized(gate_up.weight) or is_quantized(down.weight)
    if chosen == "triton" and quantized:  # the Triton kernels read dense expert weights
        chosen = backends.select("moe_lora", x.device, backend,
                                 unsupported="NF4 expert weights (the Triton kernel reads dense "
                                 "stacks)")  # fmt: skip
    if custom_ops.active() and not quantized:  # torch.compile: one graph node
        return moe_lora_op(x, top_k_index, top_k_weights, *_stack_args(gate_up),
                           *_stack_args(down), act.kind, act.interleaved, act.alpha, act.limit,
                           chosen)  # fmt: skip
    return MoELoRAFunction.apply(x, top_k_index, top_k_weights, *_stack_args(gate_up),
                                 *_stack_args(down), act, chosen)  # fmt: skip


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::moe_lora", mutates_args=())
def moe_lora_op(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, w_gu: Tensor,
                b_gu: Tensor | None, a_gu: Tensor | None, bb_gu: Tensor | None, s_gu: float,
                t_gu: bool, w_d: Tensor, b_d: Tensor | None, a_d: Tensor | None,
                bb_d: Tensor | None, s_d: float, t_d: bool, kind: str, interleaved: bool,
                alpha: float, limit: float, backend: str) -> Tensor:  # fmt: skip
    """:func:`moe_lora` (T, H)."""
    with torch.no_grad():
        return MoELoRAFunction.apply(x, top_k_index, top_k_weights, w_gu, b_gu, a_gu, bb_gu, s_gu,
                                     t_gu, w_d, b_d, a_d, bb_d, s_d, t_d,
                                     Activation(kind, interleaved, alpha, limit), backend)  # fmt: skip


@moe_lora_op.register_fake
def _(x, top_k_index, top_k_weights, *args):
    return x.new_empty(x.shape)


@torch.library.custom_op("lorafuse::moe_lora_backward", mutates_args=())
def moe_lora_backward_op(g: Tensor, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                         w_gu: Tensor, b_gu: Tensor | None, a_gu: Tensor | None,
                         bb_gu: Tensor | None, s_gu: float, t_gu: bool, w_d: Tensor,
                         b_d: Tensor | None, a_d: Tensor | None, bb_d: Tensor | None, s_d: float,
                         t_d: bool, kind: str, interleaved: bool, alpha: float, limit: float,
                         backend: str, need_x: bool, need_w: bool,
                         need_lora: bool) -> list[Tensor]:  # fmt: skip
    """``[dx, dw, dA_gu, dB_gu, dA_d, dB_d]`` (0-size where not asked for)."""
    gu = ExpertStack(w_gu, b_gu, a_gu, bb_gu, s_gu, t_gu)
    down = ExpertStack(w_d, b_d, a_d, bb_d, s_d, t_d)
    order, counts = groups.route(top_k_index, w_gu.shape[0])
    tok = torch.div(order, top_k_index.shape[1], rounding_mode="floor")
    ws = top_k_weights.reshape(-1).index_select(0, order)
    _, bwd = implementation(backend)
    dx, dws, *lora = bwd(g.contiguous(), x, tok, ws, counts, gu, down,
                         Activation(kind, interleaved, alpha, limit), need_x, need_w, need_lora)  # fmt: skip
    dw = None
    if dws is not None:
        dw = torch.empty_like(dws)
        dw[order] = dws
        dw = dw.view(top_k_weights.shape).to(top_k_weights.dtype)
    likes = (x, top_k_weights, *(t if t is not None else x for t in (a_gu, bb_gu, a_d, bb_d)))
    return [custom_ops.grad_or_empty(t, like) for t, like in zip((dx, dw, *lora), likes)]


@moe_lora_backward_op.register_fake
def _(g, x, top_k_index, top_k_weights, w_gu, b_gu, a_gu, bb_gu, *rest):
    need_x, need_w, need_lora = rest[-3:]
    a_d, bb_d = rest[4], rest[5]  # after s_gu, t_gu, w_d, b_d
    out = [x.new_empty(x.shape if need_x else (0,)),
           top_k_weights.new_empty(top_k_weights.shape if need_w else (0,))]  # fmt: skip
    for t in (a_gu, bb_gu, a_d, bb_d):
        out.append(t.new_empty(t.shape if need_lora else (0,)) if t is not None else x.new_empty(0))
    return out


def _setup(ctx, inputs, output):
    ctx.inputs = inputs  # x, the routing and the stacks: the backward op recomputes the rest


def _grad(ctx, g):
    ins = ctx.inputs
    need = ctx.needs_input_grad
    need_lora = any(need[i] for i in (5, 6, 11, 12))
    dx, dw, *lora = moe_lora_backward_op(g, *ins[:20], need[0], need[2], need_lora)
    dx, dw = (dx if need[0] else None), (dw if need[2] else None)
    da_gu, db_gu, da_d, db_d = (t if t.numel() else None for t in lora)
    grads = [dx, None, dw, None, None, da_gu if need[5] else None, db_gu if need[6] else None]
    grads += [None, None, None, None, da_d if need[11] else None, db_d if need[12] else None]
    return (*grads, *(None,) * 7)


moe_lora_op.register_autograd(_grad, setup_context=_setup)
