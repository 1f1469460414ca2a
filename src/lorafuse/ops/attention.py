"""Causal self-attention for training on CPU: q, k, v in, (B, T, Hq, D) out, GQA included.

``out = softmax(scale·q·kᵀ + causal mask)·v``; query head h reads kv head ``h // (Hq / Hk)``.
Shapes: q (B, Hq, T, D), k/v (B, Hk, T, D) -> out (B, T, Hq, D) contiguous. Only the training
case (:func:`supported`). Saved for backward: q, k, v, out and the per-row log-sum-exp;
backward recomputes the probabilities block by block. :func:`kernel` is the one choice of
implementation. The C++ kernel's blocks, products and rounding: docs/kernels.md.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafuse import backends, hardware
from lorafuse.ops import autocast, custom_ops

# ---- Policy: C++ kernel or torch's flash kernel by length, and the C++ products' dtype ----

# Longest sequence where the C++ kernel was measured faster than torch's flash kernel, per how its
# products run; past it, `auto` runs torch's kernel. `python benchmarks/probes/attention_length.py`
# (fwd + bwd, Hq=9/Hk=3, D=64, 2 threads), C++ / flash speed at the limit: fp32 1.25x at 1x1024
# (AMX Xeon; 1.05x at 1x2048); MKL's bf16 GEMM 1.2x at 1x2048 (0.8x at 1x8192); oneDNN's brgemm
# (head dim a multiple of 16) 1.4x at 1x8192 on an AMX Xeon, 2.1x on an AVX-512-BF16 EPYC.
AUTO_MAX_LENGTH = {"fp32": 1024, "native low precision": 2048, "native bf16 (brgemm)": 8192}


def kernel_dtype(q: torch.Tensor) -> torch.dtype:
    """The storage (and product) dtype the C++ kernel runs for ``q``: bf16 where bf16 products
    are native and torch's MKL has the bf16 GEMM, else fp32 (inputs upcast)."""
    if q.dtype == torch.float32 or hardware.matmul_dtype(q.device, q.dtype) != torch.bfloat16:
        return torch.float32
    if not backends.compiled("attention", "cpp", "bf16_available")[0]():
        _warn_no_bf16_gemm()
        return torch.float32
    return torch.bfloat16


@functools.cache
def _warn_no_bf16_gemm() -> None:
    warnings.warn(
        "lorafuse: this CPU multiplies bf16 natively but torch's BLAS has no "
        "cblas_gemm_bf16bf16f32 (not MKL); the C++ attention computes bf16 inputs in fp32",
        RuntimeWarning,
        stacklevel=4,
    )


# A question to the built extension, never about tensor values: constant while torch.compile
# traces (Dynamo cannot trace the pybind call), as backends.select is (ops.custom_ops).
@torch.compiler.assume_constant_result
def brgemm_products(head_dim: int) -> bool:
    """Whether the C++ kernel multiplies bf16 inputs of this head dim through oneDNN's brgemm
    (AMX or AVX-512-BF16, head dim a multiple of 16), not MKL's bf16 GEMM (or fp32 when there is
    none)."""
    if not backends.cpp_ready("attention"):
        return False
    bf16_gemm, products = backends.compiled("attention", "cpp", "bf16_available", "bf16_products")
    return bf16_gemm() and products(head_dim) == "brgemm"


def length_kind(q: torch.Tensor) -> str:
    """Which measured crossover of :data:`AUTO_MAX_LENGTH` applies to ``q``: fp32 products, bf16
    through oneDNN's brgemm, or other native low-precision products."""
    if hardware.matmul_dtype(q.device, q.dtype) == torch.float32:
        return "fp32"
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and brgemm_products(q.shape[-1]):
        return "native bf16 (brgemm)"
    return "native low precision"


def kernel(q: torch.Tensor, backend: str | None = None) -> str:
    """The implementation that runs causal attention on ``q`` (B, Hq, T, D): the length rule, then
    :func:`lorafuse.backends.select`; the op and the patched attention both ask here. There is no
    Triton attention: on CUDA torch's SDPA is FlashAttention already, so a ``triton`` request
    means ``auto`` (which keeps SDPA on CUDA)."""
    backend = _request(backend)
    if auto_prefers_torch(q, backend):
        return "torch"
    return backends.select("attention", q.device, backend)


def default_kernel(device: torch.device, backend: str | None = None) -> str:
    """:func:`kernel` for calls within the length limit on ``device`` (the patch report's line)."""
    return backends.select("attention", device, _request(backend))


def _request(backend: str | None) -> str | None:
    return None if backend == "triton" else backend


def auto_prefers_torch(q: torch.Tensor, backend: str | None) -> bool:
    """Under ``auto``, sequences longer than :data:`AUTO_MAX_LENGTH` run torch's flash kernel
    (measured faster there); the choice is recorded with its reason."""
    if backends.requested(backend) != "auto":
        return False
    kind = length_kind(q)
    limit = AUTO_MAX_LENGTH[kind]
    if q.shape[2] <= limit:
        return False
    why = f"auto: {q.shape[2]} > {limit} tokens ({kind} products): torch's flash kernel measured faster"
    backends.record("attention", q.device, "torch", why)
    return True


# ---- The op: reference, autograd.Function, entry point ------------------------------------


def causal_attention_reference(q, k, v, scale: float) -> torch.Tensor:
    """Plain autograd math through torch's SDPA, as transformers' ``sdpa`` interface runs it."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2).contiguous()


def cpp_forward(q, k, v, scale: float):
    """The C++ kernel: ``(out (B, T, Hq, D) in q's dtype, lse (B, Hq, T) fp32)``."""
    fwd, _ = backends.compiled("attention", "cpp", "forward", "backward")
    dt = kernel_dtype(q)
    out, lse = fwd(q.to(dt), k.to(dt), v.to(dt), scale)  # (B, T, Hq, D), (B, Hq, T)
    return out.to(q.dtype), lse  # no copy when the kernel ran in q's dtype


def cpp_backward(dout, q, k, v, out, lse, scale: float):
    """The C++ kernel's ``(dq, dk, dv)`` in q's dtype (the forward's product dtype)."""
    _, bwd = backends.compiled("attention", "cpp", "forward", "backward")
    dt = kernel_dtype(q)
    up = [t.to(dt) for t in (dout, q, k, v, out)]
    grads = bwd(up[0].contiguous(), *up[1:4], up[4].contiguous(), lse, scale)
    return tuple(g.to(q.dtype) for g in grads)


class CausalAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = cpp_forward(q, k, v, scale)
        # Saved in the inputs' dtype (o_proj keeps `out` anyway); backward casts the same way.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = cpp_backward(dout, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None


def supported(q, k, attention_mask=None, dropout: float = 0.0, sliding_window=None) -> bool:
    """Whether a call is the plain causal case this op computes (else use the model's own)."""
    T = q.shape[2]
    return (
        attention_mask is None
        and T > 1
        and k.shape[2] == T
        and dropout == 0.0
        and (sliding_window is None or sliding_window >= T)
    )


def _check(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"causal_attention: q must be (B, Hq, T, D) and k, v (B, Hk, T, D), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    B, Hq, T, D = q.shape
    if k.shape[0] != B or tuple(k.shape[2:]) != (T, D) or Hq % k.shape[1]:
        raise ValueError(f"causal_attention: k {tuple(k.shape)} does not fit q {tuple(q.shape)} "
                         "(batch, length and head dim must agree; Hq a multiple of Hk)")  # fmt: skip
    if not q.is_floating_point() or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"causal_attention: q, k, v must share a float dtype, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")  # fmt: skip


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str | None = None
) -> torch.Tensor:
    """Causal attention of ``q`` (B, Hq, T, D) over ``k``, ``v`` (B, Hk, T, D) -> (B, T, Hq, D)."""
    dt = autocast.autocast_dtype(q)
    if dt is not None:  # as SDPA under autocast: q, k, v (and so out) in its dtype
        with autocast.disabled(q.device):
            return causal_attention(*(autocast.cast(t, dt) for t in (q, k, v)), scale, backend)
    _check(q, k, v)
    # The length rule first, so a long sequence records one choice (torch, and why); select()
    # also runs the kernel's BLAS self-test once (backends.CPP_SELF_TEST): without an sgemm in
    # torch's libraries it warns once and answers torch.
    if kernel(q, backend) == "torch":
        return causal_attention_reference(q, k, v, scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        return causal_attention_op(q, k, v, float(scale))[0]
    return CausalAttentionFunction.apply(q, k, v, float(scale))


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::causal_attention", mutates_args=())
def causal_attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out (B, T, Hq, D) in q's dtype, lse (B, Hq, T) fp32)`` from the C++ kernel."""
    return cpp_forward(q, k, v, scale)


@causal_attention_op.register_fake
def _(q, k, v, scale):
    B, Hq, T, D = q.shape
    return q.new_empty(B, T, Hq, D), q.new_empty(B, Hq, T, dtype=torch.float32)


@torch.library.custom_op("lorafuse::causal_attention_backward", mutates_args=())
def causal_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, contiguous, shaped as q, k, v."""
    return tuple(t.contiguous() for t in cpp_backward(dout, q, k, v, out, lse, scale))


@causal_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_setup(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


def _attention_grad(ctx, dout, _g_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = causal_attention_backward_op(dout, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


causal_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)
