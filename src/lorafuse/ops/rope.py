"""Fused rotary position embedding (HF ``rotate_half`` convention) for q and k in one call.

``out = t·cos + rotate_half(t)·sin``, ``rotate_half(t) = cat(-t[..., D/2:], t[..., :D/2])``,
as ``transformers``' ``apply_rotary_pos_emb`` computes it (``unsqueeze_dim=1``).

Shapes: q (B, Hq, T, D), k (B, Hk, T, D) — as HF passes them, usually transposed views of the
(B, T, H, D) projection; cos/sin (B, T, D) or (1, T, D) (one table for every batch row).

* Fused: the two products, the half rotation and the sum, for q and k in one pass, in fp32
  with one rounding to q's dtype (HF rounds each product in bf16).
* Saved for backward: nothing but ``cos``/``sin`` (which the model keeps anyway). Backward is
  the transposed rotation, ``d·cos + rotate_halfᵀ(d·sin)``, with
  ``rotate_halfᵀ(u) = cat(u[..., D/2:], -u[..., :D/2])``.
* Copies: the torch path reads q and k through their strides (no copy); the fast kernels take
  contiguous q/k, so a transposed view costs one copy there. cos/sin are passed
  with their batch of 1 as is (never expanded to B).
* Output dtype is q's (HF would promote bf16 q with fp32 cos to fp32; HF's own rotary module
  always hands cos/sin in q's dtype, where the two agree).

Backends (chosen in :mod:`lorafuse.backends`): ``torch`` (this file), ``cpp``
(``csrc/rope.cpp``: ``rope_forward``/``rope_backward``), ``triton`` (``triton/rope.py``).

Under ``torch.compile`` (end of this file): ``lorafuse::rope(q, k, cos, sin, backend) -> (q,
k)``; backward ``rope_backward``. Outputs are contiguous (B, H, T, D) (the C++/Triton kernels'
layout; the torch path pays one copy for a transposed q).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import custom_ops


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input (HF's helper, verbatim)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_t(u: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`rotate_half`: ``cat(u[D/2:], -u[:D/2])``."""
    h = u.shape[-1] // 2
    return torch.cat((u[..., h:], -u[..., :h]), dim=-1)


def rope_reference(q, k, cos, sin):
    """Plain autograd math, line for line ``apply_rotary_pos_emb``: the test oracle."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def _torch_forward(q, k, cos, sin):
    """``(q_out, k_out)`` in q's / k's dtype; fp32 math; any strides."""
    c = cos.to(torch.float32).unsqueeze(1)  # (B|1, 1, T, D)
    s = sin.to(torch.float32).unsqueeze(1)

    def rot(t):
        t32 = t.to(torch.float32)
        return (t32 * c + rotate_half(t32) * s).to(t.dtype)

    return rot(q), rot(k)


def _torch_backward(dq, dk, cos, sin):
    """``(dq_in, dk_in)``: the transposed rotation of the incoming gradients."""
    c = cos.to(torch.float32).unsqueeze(1)  # (B|1, 1, T, D)
    s = sin.to(torch.float32).unsqueeze(1)

    def rot_t(d):
        d32 = d.to(torch.float32)
        return (d32 * c + _rotate_half_t(d32 * s)).to(d.dtype)

    return rot_t(dq), rot_t(dk)


def _contiguous(kernel):
    """The fast kernels take contiguous q/k; the torch path reads any strides."""
    return lambda a, b, cos, sin: kernel(a.contiguous(), b.contiguous(), cos, sin)


def _implementation(backend: str):
    if backend == "torch":
        return _torch_forward, _torch_backward
    fwd, bwd = backends.compiled("rope", backend, "forward", "backward")
    return _contiguous(fwd), _contiguous(bwd)


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, backend):
        fwd, _ = _implementation(backend)
        ctx.save_for_backward(cos, sin)
        ctx.backend = backend
        return fwd(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        need_q, need_k = ctx.needs_input_grad[:2]
        if not (need_q or need_k):
            return None, None, None, None, None
        _, bwd = _implementation(ctx.backend)
        dq_in, dk_in = bwd(dq, dk, cos, sin)
        return (dq_in if need_q else None), (dk_in if need_k else None), None, None, None


def _check(q, k, cos, sin):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be (B, H, T, D), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")  # fmt: skip
    B, _, T, D = q.shape
    if k.shape[0] != B or tuple(k.shape[2:]) != (T, D):
        raise ValueError(f"apply_rope: k {tuple(k.shape)} does not match q {tuple(q.shape)} "
                         "(batch, seq and head dim must agree)")  # fmt: skip
    if D % 2:
        raise ValueError(f"apply_rope: head dim must be even, got {D}")
    if not q.is_floating_point() or q.dtype != k.dtype:
        raise ValueError(f"apply_rope: q ({q.dtype}) and k ({k.dtype}) must share a float dtype")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, B) or tuple(t.shape[1:]) != (T, D):
            raise ValueError(f"apply_rope: {name} must be ({B} or 1, {T}, {D}) for q "
                             f"{tuple(q.shape)}, got {tuple(t.shape)}")  # fmt: skip
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"apply_rope: {name} requires grad; the fused rotary computes no "
                             "gradient for the cos/sin tables")  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"apply_rope: {name} on {t.device}, q on {q.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` (B, Hq, T, D) and ``k`` (B, Hk, T, D); returns ``(q, k)``."""
    _check(q, k, cos, sin)
    chosen = backends.select("rope", q.device, backend)
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        return rope_op(q, k, cos.contiguous(), sin.contiguous(), chosen)
    return RoPEFunction.apply(q, k, cos.contiguous(), sin.contiguous(), chosen)


def rope_stepwise_cpp(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` in one C++ call with its roundings
    (``csrc/rope.cpp``'s ``rope_stepwise``, bit for bit) for bf16 / fp16 decoding, no autograd;
    q, k (B, H, T, D), cos, sin (B, T, D), one dtype."""
    (kernel,) = backends.compiled("rope", "cpp", "stepwise")
    return kernel(q.contiguous(), k.contiguous(), cos, sin)


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::rope", mutates_args=())
def rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """Rotated ``(q, k)``, contiguous (B, H, T, D) (the fake's layout, whatever q's strides)."""
    fwd, _ = _implementation(backend)
    q_out, k_out = fwd(q, k, cos, sin)
    return q_out.contiguous(), k_out.contiguous()


@rope_op.register_fake
def _(q, k, cos, sin, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("lorafuse::rope_backward", mutates_args=())
def rope_backward_op(
    dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    """The transposed rotation of ``(dq, dk)``, contiguous."""
    _, bwd = _implementation(backend)
    dq_in, dk_in = bwd(dq, dk, cos, sin)
    return dq_in.contiguous(), dk_in.contiguous()


@rope_backward_op.register_fake
def _(dq, dk, cos, sin, backend):
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _rope_setup(ctx, inputs, output):
    _q, _k, cos, sin, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backend = backend


def _rope_grad(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    need_q, need_k = ctx.needs_input_grad[:2]
    if not (need_q or need_k):
        return None, None, None, None, None
    dq_in, dk_in = rope_backward_op(dq, dk, cos, sin, ctx.backend)
    return (dq_in if need_q else None), (dk_in if need_k else None), None, None, None


rope_op.register_autograd(_rope_grad, setup_context=_rope_setup)
