"""Fused RMSNorm with Hugging Face Llama semantics and a hand-written backward.

``y = weight * (x.float() * rsqrt(mean(x.float()², -1) + eps)).to(x.dtype)`` (LlamaRMSNorm's
rounding); ``round_once=True``: ``(x.float() * rstd * weight.float()).to(x.dtype)`` (Gemma,
Qwen3.5, OLMo 3). Shapes (leading dims flattened): x (N, d), weight (d,), y (N, d). Saved for
backward: x, weight and ``rstd`` (N,) fp32; the normalised value is recomputed. A trainable
weight gets ``dw`` (fp32 accumulation), never frozen silently. Mixed dtypes, backends and the
custom op: docs/kernels.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import custom_ops

# ---- Policy: decoding's no-grad norm where backends picks C++; mixed dtypes run torch ----


def no_grad_cpp_chosen() -> bool:
    """Whether :func:`rms_norm_no_grad_cpp` may run here: ``backends`` chooses the C++ kernel for
    ``rms_norm`` on CPU (the choice is recorded)."""
    return backends.select_cpu("rms_norm") == "cpp"


# ---- The op: reference, autograd.Function, entry point ------------------------------------


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, round_once: bool = False
) -> torch.Tensor:
    """Plain autograd math, line for line ``LlamaRMSNorm.forward`` (``round_once``: as
    ``Olmo3RMSNorm`` / Gemma's norms with their weight): the test oracle."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if round_once:
        return (h * weight.to(torch.float32)).to(input_dtype)
    return weight * h.to(input_dtype)


def _torch_forward(x, weight, eps, round_once=False):
    """Returns ``(y (N, d), rstd (N,) fp32)``; y in x's dtype (Llama's rounding: promoted with
    weight's if mixed)."""
    h = x.to(torch.float32)  # (N, d); no copy for fp32 x
    rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)  # (N,)
    if round_once:
        return (h * rstd[:, None] * weight.to(torch.float32)).to(x.dtype), rstd
    y = weight * (h * rstd[:, None]).to(x.dtype)
    return y, rstd


def _torch_backward(g, x, weight, rstd, needs, round_once=False):
    """Gradients ``(dx (N, d) x dtype, dw (d,) weight dtype)``, each None unless asked for."""
    need_dx, need_dw = needs
    dx = dw = None
    n = x.to(torch.float32) * rstd[:, None]  # (N, d) normalised input, recomputed
    g32 = g.to(torch.float32)
    if need_dw:
        # dL/dw = Σ_rows g · n.to(x.dtype), the rounded value the forward multiplied (rounded
        # once: n itself).
        n_used = n if round_once else n.to(x.dtype).to(torch.float32)
        dw = (g32 * n_used).sum(0).to(weight.dtype)  # (d,)
    if need_dx:
        gn = g32 * weight.to(torch.float32)  # (N, d) gradient w.r.t. n
        # d(n)/d(x) for n = x·rstd(x): rstd·(gn - n·mean(gn·n)).
        dx = (gn - n * (gn * n).mean(-1, keepdim=True)).mul_(rstd[:, None]).to(x.dtype)
    return dx, dw


def _implementation(backend: str, round_once: bool = False):
    if backend == "torch":
        if round_once:
            return (lambda x, w, eps: _torch_forward(x, w, eps, True),
                    lambda g, x, w, rstd, needs: _torch_backward(g, x, w, rstd, needs, True))  # fmt: skip
        return _torch_forward, _torch_backward
    if round_once:
        return backends.compiled("rms_norm", backend, "once_forward", "once_backward")
    return backends.compiled("rms_norm", backend, "forward", "backward")


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, backend, round_once=False):
        fwd, _ = _implementation(backend, round_once)
        y, rstd = fwd(x, weight, float(eps))
        ctx.save_for_backward(x, weight, rstd)
        ctx.backend, ctx.round_once = backend, round_once
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        if not any(needs):
            return None, None, None, None, None
        _, bwd = _implementation(ctx.backend, ctx.round_once)
        dx, dw = bwd(g.contiguous(), x, weight, rstd, needs)
        return dx, dw, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    backend: str | None = None,
    round_once: bool = False,
) -> torch.Tensor:
    """HF-Llama RMSNorm of ``x`` (..., d) with ``weight`` (d,); returns (..., d). ``round_once``:
    the weight multiply in fp32 and one rounding to x's dtype (Gemma, Qwen3.5, OLMo 3)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(
            f"rms_norm: x must be a floating-point tensor, got {getattr(x, 'dtype', x)}"
        )
    d = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or weight.dim() != 1 or weight.shape[0] != d:
        raise ValueError(
            f"rms_norm: weight must be ({d},) for x {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if not weight.is_floating_point():
        raise ValueError(f"rms_norm: weight must be floating point, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight on {weight.device}, x on {x.device}")
    if not eps >= 0.0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    why = None
    if weight.dtype != x.dtype and not round_once:  # Llama semantics: equal dtypes
        why = f"weight dtype {weight.dtype} differs from input dtype {x.dtype}"
    elif round_once and (x.device.type != "cpu" or backends.requested(backend) == "triton"):
        why = "the rounded-once norm has no Triton kernel"  # only torch and C++ compute it
    chosen = backends.select("rms_norm", x.device, backend, unsupported=why)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d).contiguous()  # (N, d)
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        y, _rstd = rms_norm_op(x2, weight.contiguous(), float(eps), chosen, round_once)
    else:
        y = RMSNormFunction.apply(x2, weight.contiguous(), eps, chosen, round_once)
    return y.reshape(*lead, d)


def rms_norm_no_grad_cpp(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` forward through the C++ kernel alone, with no autograd wrapper: decoding's
    one-row calls (``patching.decoding``, which chose ``cpp`` through ``backends``), where the
    Function's bookkeeping costs as much as the norm. x (..., d), same dtype as ``weight``."""
    forward, _ = backends.compiled("rms_norm", "cpp", "forward", "backward")
    d = x.shape[-1]
    y, _rstd = forward(x.reshape(-1, d).contiguous(), weight, float(eps))
    return y.view(x.shape)


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::rms_norm", mutates_args=())
def rms_norm_op(
    x: Tensor, weight: Tensor, eps: float, backend: str, round_once: bool = False
) -> tuple[Tensor, Tensor]:
    """``(y (N, d), rstd (N,) fp32)``: :func:`lorafuse.ops.rms_norm._torch_forward`'s contract."""
    fwd, _ = _implementation(backend, round_once)
    return tuple(fwd(x, weight, eps))


@rms_norm_op.register_fake
def _(x, weight, eps, backend, round_once=False):
    dtype = x.dtype if round_once else torch.promote_types(x.dtype, weight.dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("lorafuse::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    g: Tensor,
    x: Tensor,
    weight: Tensor,
    rstd: Tensor,
    needs: list[bool],
    backend: str,
    round_once: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(dx, dw)``; each a 0-size tensor unless asked for in ``needs``."""
    _, bwd = _implementation(backend, round_once)
    dx, dw = bwd(g.contiguous(), x, weight, rstd, tuple(needs))
    return custom_ops.grad_or_empty(dx, x), custom_ops.grad_or_empty(dw, weight)


@rms_norm_backward_op.register_fake
def _(g, x, weight, rstd, needs, backend, round_once=False):
    return (x.new_empty(x.shape) if needs[0] else x.new_empty(0),
            weight.new_empty(weight.shape) if needs[1] else weight.new_empty(0))  # fmt: skip


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _eps, backend, *rest = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.backend, ctx.round_once = backend, bool(rest and rest[0])


def _rms_norm_grad(ctx, g, _g_rstd):
    x, weight, rstd = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    if not any(needs):
        return None, None, None, None, None
    dx, dw = rms_norm_backward_op(g, x, weight, rstd, needs, ctx.backend, ctx.round_once)
    return (dx if needs[0] else None), (dw if needs[1] else None), None, None, None


rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)
