"""The fused ops as PyTorch custom ops (namespace ``lorafuse``), so ``torch.compile`` traces them.

A plain ``autograd.Function`` around a C++ (pybind) or Triton kernel is opaque to Dynamo: every
call is a graph break. Registered with :func:`torch.library.custom_op`, each op is one node of
the compiled graph, with a fake implementation (shapes and dtypes only, for tracing) and an
autograd formula whose backward is itself a custom op, so compiled backward graphs hold no break
either. This module is only the registration: the math stays in each op's file
(``_torch_forward``/``_torch_backward`` and the C++/Triton kernels picked by
:mod:`lorafuse.backends`), looked up when the op runs.

Registered (forward -> saved -> backward op):

* ``lora_linear(x, W, b, A, B, scaling, mask, keep, backend) -> (y, xa)``; backward
  ``lora_linear_backward``. ``xa`` (N, r) is an output only so it can be saved.
* ``dora_weight_norm(W, A, B, scaling, backend) -> n`` (no gradient) and ``dora_linear(x, W, b,
  A, B, scale, scaling, mask, keep, backend) -> (y, xa, h)``, ``scale = m/n`` an input so the
  magnitude's gradient is autograd's division; backward ``dora_linear_backward``.
* ``rms_norm(x, w, eps, backend) -> (y, rstd)``; backward ``rms_norm_backward``.
* ``rope(q, k, cos, sin, backend) -> (q, k)``; backward ``rope_backward``. Outputs are contiguous
  (B, H, T, D) (the C++/Triton kernels' layout; the torch path pays one copy for a transposed q).
* ``swiglu(gate, up, backend) -> h``; backward ``swiglu_backward``.
* ``causal_attention(q, k, v, scale) -> (out, lse)``; backward ``causal_attention_backward``
  (the C++ kernel; the torch choice is SDPA, which Dynamo traces without help).
* ``linear_cross_entropy(...) -> (loss, grad_h, grad_w, grad_b)``: the gradients are computed
  in forward (see :mod:`lorafuse.ops.cross_entropy`); its backward scales them by the incoming
  gradient with plain tensor ops. Row dropping and the target check run inside the op
  (data-dependent shapes would otherwise break the graph).

Outside every op, in traceable Python at the entry points: backend selection
(:func:`lorafuse.backends.select`, constant for a compiled graph: changing ``LORAFUSE_KERNELS``
after the first compiled call does not recompile), autocast casts, the dropout
mask draw (``bernoulli_``; under Inductor it uses Inductor's RNG, so masks differ from eager's
draws while the distribution is the same), flattening and input checks.

When these ops run: inside ``torch.compile`` only (:func:`active`); eager keeps the
``autograd.Function`` of each op file, which saves less (e.g. ``lora_qkv``/``lora_mlp`` are one
node there) and measured faster on small shapes (docs/compile.md). Under compile ``lora_qkv`` and
``lora_mlp`` are composed from ``lora_linear``/``swiglu`` nodes: ``x`` is still saved once (one
tensor), but the MLP keeps ``h = silu(gate)*up`` (N, I) for the down projection's backward
instead of recomputing it.

Not covered: quantized base weights (NF4) stay on the eager ``autograd.Function`` path; under
compile they are dequantized outside the op (so the dense copy is saved for backward) and that
path is not tested under compile. Double backward is not supported (the backward ops have no
autograd of their own).
"""

import torch
from torch import Tensor

from lorafuse import backends, hardware
from lorafuse.ops import autocast

# Backend selection is Python with caches, locks (the C++ build) and a record of each choice:
# Dynamo cannot trace it, and its answer depends only on the op, the device, the request and
# the environment, never on tensor values. Marked constant, it runs once while a graph is traced
# (recording its choice as in eager) and the compiled graph holds the answer.
torch.compiler.assume_constant_result(backends.select)
# Likewise whether bf16/fp16 products are native here (env var and /proc/cpuinfo: the attention
# length rule and the fused loss ask it under autocast).
torch.compiler.assume_constant_result(hardware.native_low_precision_matmul)


def active() -> bool:
    """Whether the entry points route through the custom ops: while ``torch.compile`` traces."""
    return torch.compiler.is_compiling()


def _grad_or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """Custom ops cannot return None: a gradient nobody asked for comes back as a 0-size tensor."""
    return like.new_empty(0) if t is None else t


# --------------------------------------------------------------------------------------------
# lora_linear


@torch.library.custom_op("lorafuse::lora_linear", mutates_args=())
def lora_linear(
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
    from lorafuse.ops import lora_linear as m

    fwd, _ = m._implementation(backend)
    return tuple(fwd(x, weight, bias, lora_A, lora_B, scaling, mask, keep))


@lora_linear.register_fake
def _(x, weight, bias, lora_A, lora_B, scaling, mask, keep, backend):
    n = x.shape[0]
    return x.new_empty(n, weight.shape[0]), x.new_empty(n, lora_A.shape[0], dtype=lora_A.dtype)


@torch.library.custom_op("lorafuse::lora_linear_backward", mutates_args=())
def lora_linear_backward(
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
    from lorafuse.ops import lora_linear as m

    _, bwd = m._implementation(backend)
    with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
        grads = bwd(
            g.contiguous(), x, weight, lora_A, lora_B, xa, scaling, mask, keep, tuple(needs)
        )
    return tuple(_grad_or_empty(t, g) for t in grads)


@lora_linear_backward.register_fake
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
    dx, dA, dB, db = lora_linear_backward(
        g, x, weight, lora_A, lora_B, xa, ctx.scaling, mask, ctx.keep, needs, ctx.backend
    )
    pick = [t if need else None for t, need in zip((dx, dA, dB, db), needs)]
    return pick[0], None, pick[3], pick[1], pick[2], None, None, None, None


lora_linear.register_autograd(_lora_linear_grad, setup_context=_lora_linear_setup)


# --------------------------------------------------------------------------------------------
# dora_linear (ops/dora.py): the weight norm (no gradient), forward -> (y, xa, h), backward. The
# scale m/n enters as an input, so autograd's division gives the magnitude its gradient.


@torch.library.custom_op("lorafuse::dora_weight_norm", mutates_args=())
def dora_weight_norm(
    weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float, backend: str
) -> Tensor:
    """``||W_j + s·(B·A)_j||`` (k,): :func:`lorafuse.ops.dora.weight_norm` of a dense W."""
    from lorafuse.ops import dora

    return dora.weight_norm(weight, lora_A, lora_B, scaling, weight.dtype, backend)


@dora_weight_norm.register_fake
def _(weight, lora_A, lora_B, scaling, backend):
    return lora_A.new_empty(weight.shape[0], dtype=torch.promote_types(lora_A.dtype, torch.float32))


@torch.library.custom_op("lorafuse::dora_linear", mutates_args=())
def dora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Tensor,
    lora_B: Tensor,
    scale: Tensor,
    scaling: float,
    mask: Tensor | None,
    keep: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y (N, k), xa (N, r), h (N, k))``: :func:`lorafuse.ops.dora.dora_forward`."""
    from lorafuse.ops import dora

    return tuple(dora.dora_forward(x, weight, bias, lora_A, lora_B, scale, scaling, mask, keep,
                                   backend))  # fmt: skip


@dora_linear.register_fake
def _(x, weight, bias, lora_A, lora_B, scale, scaling, mask, keep, backend):
    n, k = x.shape[0], weight.shape[0]
    return x.new_empty(n, k), x.new_empty(n, lora_A.shape[0], dtype=lora_A.dtype), x.new_empty(n, k)


@torch.library.custom_op("lorafuse::dora_linear_backward", mutates_args=())
def dora_linear_backward(
    g: Tensor,
    x: Tensor,
    weight: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    xa: Tensor,
    mask: Tensor | None,
    h: Tensor,
    scale: Tensor,
    scaling: float,
    keep: float,
    needs: list[bool],
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, db, dA, dB, dscale)``; each a 0-size tensor unless asked for in ``needs``."""
    from lorafuse.ops import dora

    with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
        grads = dora.dora_backward(g, x, weight, lora_A, lora_B, xa, mask, h, scale, scaling,
                                   keep, tuple(needs), backend)  # fmt: skip
    return tuple(_grad_or_empty(t, g) for t in grads)


@dora_linear_backward.register_fake
def _(g, x, weight, lora_A, lora_B, xa, mask, h, scale, scaling, keep, needs, backend):
    shapes = ((x.shape, x.dtype), ((weight.shape[0],), g.dtype), (lora_A.shape, lora_A.dtype),
              (lora_B.shape, lora_B.dtype), (scale.shape, scale.dtype))  # fmt: skip
    return tuple(
        g.new_empty(s, dtype=dt) if need else g.new_empty(0) for need, (s, dt) in zip(needs, shapes)
    )


def _dora_linear_setup(ctx, inputs, output):
    x, weight, _bias, lora_A, lora_B, scale, scaling, mask, keep, backend = inputs
    ctx.save_for_backward(x, weight, lora_A, lora_B, output[1], mask, output[2], scale)
    ctx.scaling, ctx.keep, ctx.backend = scaling, keep, backend


def _dora_linear_grad(ctx, g, _g_xa, _g_h):
    x, weight, lora_A, lora_B, xa, mask, h, scale = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[2], n[3], n[4], n[5]]  # dx, db, dA, dB, dscale
    if not any(needs):
        return (None,) * 10
    grads = dora_linear_backward(g, x, weight, lora_A, lora_B, xa, mask, h, scale, ctx.scaling,
                                 ctx.keep, needs, ctx.backend)  # fmt: skip
    dx, db, dA, dB, ds = (t if need else None for t, need in zip(grads, needs))
    return dx, None, db, dA, dB, ds, None, None, None, None


dora_linear.register_autograd(_dora_linear_grad, setup_context=_dora_linear_setup)


# --------------------------------------------------------------------------------------------
# rms_norm


@torch.library.custom_op("lorafuse::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, backend: str) -> tuple[Tensor, Tensor]:
    """``(y (N, d), rstd (N,) fp32)``: :func:`lorafuse.ops.rms_norm._torch_forward`'s contract."""
    from lorafuse.ops import rms_norm as m

    fwd, _ = m._implementation(backend)
    return tuple(fwd(x, weight, eps))


@rms_norm.register_fake
def _(x, weight, eps, backend):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("lorafuse::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    g: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, needs: list[bool], backend: str
) -> tuple[Tensor, Tensor]:
    """``(dx, dw)``; each a 0-size tensor unless asked for in ``needs``."""
    from lorafuse.ops import rms_norm as m

    _, bwd = m._implementation(backend)
    dx, dw = bwd(g.contiguous(), x, weight, rstd, tuple(needs))
    return _grad_or_empty(dx, x), _grad_or_empty(dw, weight)


@rms_norm_backward.register_fake
def _(g, x, weight, rstd, needs, backend):
    return (x.new_empty(x.shape) if needs[0] else x.new_empty(0),
            weight.new_empty(weight.shape) if needs[1] else weight.new_empty(0))  # fmt: skip


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _eps, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.backend = backend


def _rms_norm_grad(ctx, g, _g_rstd):
    x, weight, rstd = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    if not any(needs):
        return None, None, None, None
    dx, dw = rms_norm_backward(g, x, weight, rstd, needs, ctx.backend)
    return (dx if needs[0] else None), (dw if needs[1] else None), None, None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# --------------------------------------------------------------------------------------------
# rope


@torch.library.custom_op("lorafuse::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """Rotated ``(q, k)``, contiguous (B, H, T, D) (the fake's layout, whatever q's strides)."""
    from lorafuse.ops import rope as m

    fwd, _ = m._implementation(backend)
    q_out, k_out = fwd(q, k, cos, sin)
    return q_out.contiguous(), k_out.contiguous()


@rope.register_fake
def _(q, k, cos, sin, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("lorafuse::rope_backward", mutates_args=())
def rope_backward(
    dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    """The transposed rotation of ``(dq, dk)``, contiguous."""
    from lorafuse.ops import rope as m

    _, bwd = m._implementation(backend)
    dq_in, dk_in = bwd(dq, dk, cos, sin)
    return dq_in.contiguous(), dk_in.contiguous()


@rope_backward.register_fake
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
    dq_in, dk_in = rope_backward(dq, dk, cos, sin, ctx.backend)
    return (dq_in if need_q else None), (dk_in if need_k else None), None, None, None


rope.register_autograd(_rope_grad, setup_context=_rope_setup)


# --------------------------------------------------------------------------------------------
# swiglu


@torch.library.custom_op("lorafuse::swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    """``silu(gate) * up`` (N, I): :func:`lorafuse.ops.swiglu._torch_forward`'s contract."""
    from lorafuse.ops import swiglu as m

    fwd, _ = m._implementation(backend)
    return fwd(gate, up)


@swiglu.register_fake
def _(gate, up, backend):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("lorafuse::swiglu_backward", mutates_args=())
def swiglu_backward(g: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    """``(dgate, dup)`` (N, I)."""
    from lorafuse.ops import swiglu as m

    _, bwd = m._implementation(backend)
    return tuple(bwd(g.contiguous(), gate, up))


@swiglu_backward.register_fake
def _(g, gate, up, backend):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    gate, up, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.backend = backend


def _swiglu_grad(ctx, g):
    gate, up = ctx.saved_tensors
    need_g, need_u = ctx.needs_input_grad[:2]
    if not (need_g or need_u):
        return None, None, None
    dgate, dup = swiglu_backward(g, gate, up, ctx.backend)
    return (dgate if need_g else None), (dup if need_u else None), None


swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


# --------------------------------------------------------------------------------------------
# causal_attention (the C++ kernel)


@torch.library.custom_op("lorafuse::causal_attention", mutates_args=())
def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out (B, T, Hq, D) in q's dtype, lse (B, Hq, T) fp32)`` from the C++ kernel."""
    from lorafuse.ops import attention as m

    return m.cpp_forward(q, k, v, scale)


@causal_attention.register_fake
def _(q, k, v, scale):
    B, Hq, T, D = q.shape
    return q.new_empty(B, T, Hq, D), q.new_empty(B, Hq, T, dtype=torch.float32)


@torch.library.custom_op("lorafuse::causal_attention_backward", mutates_args=())
def causal_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, contiguous, shaped as q, k, v."""
    from lorafuse.ops import attention as m

    return tuple(t.contiguous() for t in m.cpp_backward(dout, q, k, v, out, lse, scale))


@causal_attention_backward.register_fake
def _(dout, q, k, v, out, lse, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_setup(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


def _attention_grad(ctx, dout, _g_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = causal_attention_backward(dout, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


causal_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


# --------------------------------------------------------------------------------------------
# linear_cross_entropy (gradients computed in forward)


@torch.library.custom_op("lorafuse::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    num_items_in_batch: Tensor | None,
    chunk_size: int | None,
    backend: str,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss () fp32, grad_h (N, H), grad_w (V, H) fp32, grad_b (V,) fp32)``, each gradient a
    0-size tensor unless asked for in ``needs`` (hidden, weight, bias); targets (N,) int64."""
    from lorafuse.ops import cross_entropy as m

    n_items = None if num_items_in_batch is None else num_items_in_batch.item()
    loss, grads = m.loss_and_grads(hidden, weight, bias, targets, ignore_index, reduction,
                                   n_items, chunk_size, backend, needs)  # fmt: skip
    return loss, *(_grad_or_empty(t, loss) for t in grads)


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch, chunk_size,
      backend, needs):  # fmt: skip
    f32 = torch.float32
    shapes = ((hidden.shape, hidden.dtype), (weight.shape, f32), ((weight.shape[0],), f32))
    grads = (hidden.new_empty(s, dtype=dt) if need else hidden.new_empty(0, dtype=f32)
             for need, (s, dt) in zip(needs, shapes))  # fmt: skip
    return hidden.new_empty((), dtype=f32), *grads


def _ce_setup(ctx, inputs, output):
    _h, weight, bias, *_rest, needs = inputs
    ctx.save_for_backward(*output[1:])
    ctx.needs = needs
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)


def _ce_grad(ctx, g, *_unused):
    grad_h, grad_w, grad_b = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs
    dh = grad_h * g.to(grad_h.dtype) if need_h else None
    dw = (grad_w * g).to(ctx.dtypes[0]) if need_w else None
    db = (grad_b * g).to(ctx.dtypes[1]) if need_b else None
    return dh, dw, db, None, None, None, None, None, None, None


linear_cross_entropy.register_autograd(_ce_grad, setup_context=_ce_setup)
