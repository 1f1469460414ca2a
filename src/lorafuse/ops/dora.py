"""Fused DoRA linear (PEFT's ``use_dora=True``) with a hand-written backward.

``y = (m/n)·h + b + (x - xd)·Wᵀ`` with ``h = xd·Wᵀ + s·(xd·Aᵀ)·Bᵀ``, xd = dropout(x) and n the
detached norm of each row of ``W + s·B·A``. Shapes (leading dims flattened): x (N, d), W (k, d)
dense or quantized, b (k,), A (r, d), B (k, r), magnitude m (k,). Saved for backward: x, the
dropout mask as bool, xa = xd·Aᵀ (N, r), h (N, k), n and m/n (k,); a quantized W is dequantized
again, never saved. The passes are :mod:`lorafuse.ops.dora_passes`; the weight norm, autocast
and backends: docs/kernels.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import autocast, custom_ops
from lorafuse.ops.dora_passes import dora_backward, dora_forward, draw_mask
from lorafuse.ops.lora_params import LoRAParams, check_params
from lorafuse.ops.weights import is_quantized, materialize, row_blocks

# ---- Policy: the weight norm's cancellation rule and chunk size --------------------------
# Rows whose expanded norm sum cancels more than this are recomputed materialised. Against fp64
# (d = 4096, r = 16, 64 rows, built as in tests/ops/test_dora.py::_cancelling):
# the expanded fp32 norm is as close as the materialised one up to κ ≈ 3.4 (1.65e-7 vs 1.64e-7
# max relative) and 2.6x farther at κ ≈ 8.9 (4.6e-7 vs 1.8e-7), growing with κ after that.
KAPPA_MAX = 4.0
# Bytes of one row chunk of W in the norm's dtype (a dense copy of a quantized W, or a cast one).
NORM_CHUNK_BYTES = 4 << 20


# ---- The op: reference, autograd.Function, entry point ------------------------------------


def dora_linear_reference(x, weight, bias, lora_A, lora_B, magnitude, scaling, noise=None):
    """PEFT's DoRA forward in plain autograd math (the test oracle); ``noise`` is the dropout
    multiplier (mask / keep) or None."""
    xl = x.to(lora_A.dtype)
    xd = xl if noise is None else xl * noise
    w = weight.to(xl.dtype)
    norm = torch.linalg.norm(w + scaling * (lora_B @ lora_A), dim=1).detach()  # (k,)
    mns = magnitude / norm  # (k,)
    base = F.linear(x, weight, bias)
    based = base - (0 if bias is None else bias) if noise is None else F.linear(xd, w)
    lora = F.linear(F.linear(xd, lora_A), lora_B) * scaling
    return (base + (mns - 1) * based + mns * lora).to(base.dtype)


def _norm_dtype(lora_A: torch.Tensor) -> torch.dtype:
    return torch.promote_types(lora_A.dtype, torch.float32)


def _row_chunks(weight, dtype: torch.dtype, ct: torch.dtype):
    """``(start, stop, rows)`` over W's rows as the forward multiplies by them (dequantized in
    ``dtype``), each chunk cast to ``ct``: about :data:`NORM_CHUNK_BYTES` each."""
    k, d = weight.shape
    if is_quantized(weight) and hasattr(weight, "rows"):
        for start, stop, w in row_blocks(weight, dtype, NORM_CHUNK_BYTES):
            yield start, stop, w.to(ct)
        return
    dense = materialize(weight, dtype)  # (k, d); transient if quantized
    step = max(1, NORM_CHUNK_BYTES // (d * ct.itemsize))
    for start in range(0, k, step):
        stop = min(k, start + step)
        yield start, stop, dense[start:stop].to(ct)


def _torch_weight_norm(weight, lora_A, lora_B, scaling: float, dtype: torch.dtype):
    """``||W_j + s·(B·A)_j||`` per row j, (k,) in fp32 (fp64 adapters: fp64): docs/kernels.md."""
    ct = _norm_dtype(lora_A)
    A, B = lora_A.to(ct), lora_B.to(ct)  # (r, d), (k, r)
    AAt = A @ A.t()  # (r, r)
    out = torch.empty(weight.shape[0], dtype=ct, device=A.device)
    for start, stop, w in _row_chunks(weight, dtype, ct):
        Bc = B[start:stop]  # (kc, r)
        a = torch.linalg.vecdot(w, w)  # ||W_j||²  (kc,)
        c = torch.linalg.vecdot(Bc, w @ A.t())  # <W_j, (B·A)_j>  (kc,)
        e = torch.linalg.vecdot(Bc @ AAt, Bc)  # ||(B·A)_j||²  (kc,)
        n2 = a + (2 * scaling) * c + (scaling * scaling) * e
        bound = a + (2 * scaling) * c.abs() + (scaling * scaling) * e
        n = out[start:stop]
        torch.sqrt(n2.clamp_min(0), out=n)
        bad = (n2 * KAPPA_MAX < bound).nonzero().flatten()  # cancelling rows (n2 <= 0 included)
        if bad.numel():
            rows = w[bad] + scaling * (Bc[bad] @ A)  # (nb, d): only those rows materialised
            n[bad] = torch.linalg.vector_norm(rows, dim=1)
    return out


def weight_norm(weight, lora_A, lora_B, scaling: float, dtype: torch.dtype, backend: str):
    """DoRA's row norm of ``W + s·B·A`` (k,), detached, in fp32 (fp64 adapters: fp64); W as
    the forward multiplies by it (a quantized one dequantized in ``dtype``)."""
    with torch.no_grad():
        A, B = lora_A.detach(), lora_B.detach()
        if backend == "triton":
            (norm,) = backends.compiled("dora_linear", "triton", "weight_norm")
            return norm(materialize(weight, dtype), A, B, float(scaling), _norm_dtype(A))
        return _torch_weight_norm(weight, A, B, float(scaling), dtype)


class DoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, magnitude, norm, scaling, dropout_p, backend):
        mask = draw_mask(x, lora_A, dropout_p)  # (N, d) bool or None
        keep = 1.0 - dropout_p
        scale = magnitude.detach().to(norm.dtype) / norm  # m/n (k,)
        y, xa, h = dora_forward(x, weight, bias, lora_A, lora_B, scale, scaling, mask, keep,
                                backend)  # fmt: skip
        ctx.quantized = weight if is_quantized(weight) else None
        dense = None if ctx.quantized is not None else weight
        ctx.save_for_backward(x, dense, lora_A, lora_B, xa, mask, h, norm, scale)
        ctx.scaling, ctx.keep, ctx.backend = float(scaling), keep, backend
        ctx.m_dtype = magnitude.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, lora_A, lora_B, xa, mask, h, norm, scale = ctx.saved_tensors
        weight = ctx.quantized if ctx.quantized is not None else weight
        need_dx, _, need_db, need_dA, need_dB, need_dm = ctx.needs_input_grad[:6]
        with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
            dx, db, dA, dB, ds = dora_backward(
                g, x, weight, lora_A, lora_B, xa, mask, h, scale, ctx.scaling, ctx.keep,
                (need_dx, need_db, need_dA, need_dB, need_dm), ctx.backend,
            )  # fmt: skip
        dm = None if ds is None else (ds / norm).to(ctx.m_dtype)  # d(m/n)/dm = 1/n
        return dx, None, db, dA, dB, dm, None, None, None, None


def _check(x, weight, bias, lora_A, lora_B, magnitude, dropout_p):
    check_params(LoRAParams(weight, bias, lora_A, lora_B, 1.0, dropout_p), x.shape[-1], x.dtype,
                 "dora_linear")  # fmt: skip
    if lora_A is None:
        raise ValueError("dora_linear: lora_A and lora_B are required")
    k = weight.shape[0]
    if magnitude.dim() != 1 or magnitude.shape[0] != k or not magnitude.is_floating_point():
        raise ValueError(
            f"dora_linear: magnitude must be a floating ({k},) vector for weight "
            f"{tuple(weight.shape)}, got {magnitude.dtype} {tuple(magnitude.shape)}"
        )


def dora_linear(
    x: torch.Tensor,
    weight,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    magnitude: torch.Tensor,
    scaling: float = 1.0,
    dropout_p: float = 0.0,
    training: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """PEFT's DoRA Linear over any leading shape of ``x`` (docs/kernels.md)."""
    _check(x, weight, bias, lora_A, lora_B, magnitude, dropout_p)
    chosen = backends.select("dora_linear", x.device, backend)
    if custom_ops.active():  # data-dependent (the κ rows): one opaque node under compile
        dense = materialize(weight, x.dtype)
        norm = dora_weight_norm_op(dense, lora_A.detach(), lora_B.detach(),
                                           float(scaling), chosen)  # fmt: skip
    else:
        norm = weight_norm(weight, lora_A, lora_B, scaling, x.dtype, chosen)  # (k,), pre-cast
    dt = autocast.autocast_dtype(x)
    p = dropout_p if training else 0.0
    with autocast.disabled(x.device) if dt is not None else contextlib.nullcontext():
        if dt is not None:  # as autocast runs F.linear: operands in its dtype (m and n: not)
            x, weight, bias, lora_A, lora_B = (
                autocast.cast(t, dt) for t in (x, weight, bias, lora_A, lora_B)
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (N, d)
        if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
            mask = draw_mask(x2, lora_A, p)
            scale = magnitude.to(norm.dtype) / norm  # m/n (k,): autograd gives dm = dscale / n
            y, _xa, _h = dora_linear_op(x2, materialize(weight, x2.dtype), bias, lora_A,
                                                lora_B, scale, float(scaling), mask, 1.0 - p,
                                                chosen)  # fmt: skip
        else:
            y = DoRALinearFunction.apply(
                x2, weight, bias, lora_A, lora_B, magnitude, norm, float(scaling), p, chosen
            )
    return y.reshape(*lead, weight.shape[0])


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


# scale m/n enters as an input, so autograd's division gives the magnitude its gradient.


@torch.library.custom_op("lorafuse::dora_weight_norm", mutates_args=())
def dora_weight_norm_op(
    weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float, backend: str
) -> Tensor:
    """``||W_j + s·(B·A)_j||`` (k,): :func:`lorafuse.ops.dora.weight_norm` of a dense W."""
    return weight_norm(weight, lora_A, lora_B, scaling, weight.dtype, backend)


@dora_weight_norm_op.register_fake
def _(weight, lora_A, lora_B, scaling, backend):
    return lora_A.new_empty(weight.shape[0], dtype=torch.promote_types(lora_A.dtype, torch.float32))


@torch.library.custom_op("lorafuse::dora_linear", mutates_args=())
def dora_linear_op(
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
    """``(y (N, k), xa (N, r), h (N, k))``: :func:`lorafuse.ops.dora_passes.dora_forward`."""
    return tuple(dora_forward(x, weight, bias, lora_A, lora_B, scale, scaling, mask, keep,
                                   backend))  # fmt: skip


@dora_linear_op.register_fake
def _(x, weight, bias, lora_A, lora_B, scale, scaling, mask, keep, backend):
    n, k = x.shape[0], weight.shape[0]
    return x.new_empty(n, k), x.new_empty(n, lora_A.shape[0], dtype=lora_A.dtype), x.new_empty(n, k)


@torch.library.custom_op("lorafuse::dora_linear_backward", mutates_args=())
def dora_linear_backward_op(
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
    with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
        grads = dora_backward(g, x, weight, lora_A, lora_B, xa, mask, h, scale, scaling,
                                   keep, tuple(needs), backend)  # fmt: skip
    return tuple(custom_ops.grad_or_empty(t, g) for t in grads)


@dora_linear_backward_op.register_fake
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
    grads = dora_linear_backward_op(g, x, weight, lora_A, lora_B, xa, mask, h, scale, ctx.scaling,
                                 ctx.keep, needs, ctx.backend)  # fmt: skip
    dx, db, dA, dB, ds = (t if need else None for t, need in zip(grads, needs))
    return dx, None, db, dA, dB, ds, None, None, None, None


dora_linear_op.register_autograd(_dora_linear_grad, setup_context=_dora_linear_setup)
