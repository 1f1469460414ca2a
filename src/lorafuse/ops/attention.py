"""Causal self-attention for training on CPU: q, k, v in, (B, T, Hq, D) out, GQA included.

``out = softmax(scale·q·kᵀ + causal mask)·v`` per batch row and query head; query head ``h``
reads kv head ``h // (Hq / Hk)``, as transformers' ``repeat_kv`` arranges it.

Shapes: q (B, Hq, T, D), k/v (B, Hk, T, D) (the HF attention interface's layout; any strides
with a contiguous head dim) -> out (B, T, Hq, D) contiguous, which is what the attention
interface returns and ``o_proj`` reads without a transpose copy.

* Only the training-time case: no mask tensor, queries and keys of the same length (no KV
  cache offset), no dropout, no sliding window. :func:`supported` says whether a call is one.
* ``torch``: ``F.scaled_dot_product_attention(is_causal=True)`` on ``repeat_kv``'d k/v, the
  reference (the flash kernel for CPU and CUDA).
* ``cpp`` (``csrc/attention.cpp``): per (batch, kv head), row blocks that multiply
  only against the keys they can see, BLAS ``sgemm`` for the products, one vectorised softmax
  pass. Saved for backward: q, k, v, out (in their own dtype) and the per-row log-sum-exp (as
  the flash kernel does); backward recomputes the probabilities block by block. Math in fp32:
  bf16/fp16 inputs are upcast in forward and again in backward (on CPUs without native bf16
  products that is also the fast way) and results cast back. About 2x faster than torch's flash kernel at 4 x 512 tokens
  (``benchmarks/bench_ops_cpu.py``), but not on long sequences: ``auto`` uses it up to
  :data:`AUTO_MAX_LENGTH` tokens.
* No Triton kernel: on CUDA torch's SDPA already dispatches to FlashAttention, so ``auto``
  keeps ``torch`` there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafuse import backends, hardware
from lorafuse.ops import autocast, custom_ops

# Longest sequence where the C++ kernel beats torch's flash kernel (fwd + bwd, Hq=9/Hk=3, D=64,
# 2 threads; `python benchmarks/bench_attention_length.py`, 2-core AMX Xeon, two runs): with fp32
# products 1.8x at 4x512, 1.4x at 1x512, 1.1-1.4x at 4x1024, 1.0-1.1x at 1x1024, 0.9x at 1x2048,
# 0.75-0.93x at 1x8192; where bf16 products are native (our kernel still multiplies in fp32)
# 1.0-1.5x at 4x512, 1.1-1.2x at 1x512, 0.8-0.95x at 4x1024, 0.7x at 1x1024, 0.4-0.6x at 1x8192.
# Past it, `auto` runs torch's kernel.
AUTO_MAX_LENGTH = {"fp32": 1024, "native low precision": 512}


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
    out, lse = fwd(q.float(), k.float(), v.float(), scale)  # (B, T, Hq, D), (B, Hq, T)
    return out.to(q.dtype), lse  # no copy for fp32


def cpp_backward(dout, q, k, v, out, lse, scale: float):
    """The C++ kernel's ``(dq, dk, dv)`` in q's dtype; fp32 math (inputs upcast again)."""
    _, bwd = backends.compiled("attention", "cpp", "forward", "backward")
    up = [t.float() for t in (dout, q, k, v, out)]
    grads = bwd(up[0].contiguous(), *up[1:4], up[4].contiguous(), lse, scale)
    return tuple(g.to(q.dtype) for g in grads)


class CausalAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = cpp_forward(q, k, v, scale)
        # Saved in the inputs' dtype (o_proj keeps `out` anyway); backward upcasts again.
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


def auto_prefers_torch(q: torch.Tensor, backend: str | None) -> bool:
    """Under ``auto``, sequences longer than :data:`AUTO_MAX_LENGTH` run torch's flash kernel
    (measured faster there); the choice is recorded with its reason."""
    products = hardware.matmul_dtype(q.device, q.dtype)
    kind = "fp32" if products == torch.float32 else "native low precision"
    limit = AUTO_MAX_LENGTH[kind]
    if backends.requested(backend) != "auto" or q.shape[2] <= limit:
        return False
    why = f"auto: {q.shape[2]} > {limit} tokens ({kind} products): torch's flash kernel measured faster"
    backends.record("attention", q.device, "torch", why)
    return True


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
    if auto_prefers_torch(q, backend) or backends.select("attention", q.device, backend) == "torch":
        return causal_attention_reference(q, k, v, scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        return custom_ops.causal_attention(q, k, v, float(scale))[0]
    return CausalAttentionFunction.apply(q, k, v, float(scale))
