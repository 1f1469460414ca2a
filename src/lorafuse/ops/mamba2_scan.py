"""Mamba2's selective state-space scan (SSD: Granite 4's mamba layers), per packed example.

Per head h, with the state ``S`` (P, N) running along the sequence:

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)      (bias and softplus optional)
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,           y_t = S_t C_t + D_h x_t

Shapes: x (B, T, H, P); dt (B, T, H); A (H,) (negative: ``-exp(A_log)``); B, C (B, T, G, N) with
H a multiple of G (each group serves H / G consecutive heads, as transformers repeats them); D and
dt_bias (H,) or None. Output y (B, T, H, P) in fp32, as transformers' torch scan returns it (the
gated norm after it reads fp32); states (N_ex, H, P, N) in fp32. fp64 inputs compute in fp64 (the
tests' oracle). Gradients come back in each input's dtype.

Examples: without ``cu_seqlens`` each batch row is one sequence (N_ex = B). With ``cu_seqlens``
(int64 (N_ex+1,), cumulative example boundaries over one row's T tokens, B = 1, FLA's varlen
convention) the state restarts at every boundary from ``initial_state[n]`` or zeros.

* :func:`mamba2_scan_reference`: the chunked (SSD) form transformers' ``mamba2_chunk_scan``
  computes, plain autograd (``ops/mamba2_scan_chunks.py``: every example padded to whole chunks of
  its own, all chunks of all examples at once, the state passed one chunk index at a time).
  :func:`mamba2_scan_recurrent`: the token-by-token recurrence (in fp64 the oracle).
* :class:`Mamba2ScanFunction`: the same forward with a hand-written backward. Saved: the inputs
  and the state at every interior chunk start (``chunk_size`` apart within each example; a quarter
  of x's fp32 bytes at Granite 4's widths); the scores and decays are recomputed.
* Backends (:mod:`lorafuse.backends`): ``torch`` (``mamba2_scan_chunks.torch_forward`` /
  ``torch_backward``), ``cpp`` (``csrc/mamba2_scan.cpp``: ``mamba2_scan_forward`` /
  ``mamba2_scan_backward``, parallel over (example, head), chunk products by BLAS in sub-chunks of
  its own; ``mamba2_scan_step``: one decoding token). No Triton kernel.

Under ``torch.compile`` (end of this file): ``lorafuse::mamba2_scan -> (y, final, saved)``,
backward ``lorafuse::mamba2_scan_backward``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import custom_ops
from lorafuse.ops.mamba2_scan_chunks import (
    compute_dtype,
    discretize,
    forward_pass,
    layout,
    n_slots,
    spans,
    torch_backward,
    torch_forward,
)

CHUNK = 256  # Mamba2's / Granite 4's default chunk length; results depend on it only by rounding
NO_LIMIT = (0.0, math.inf)

# ---- Policy: one decoding token (T = 1, no gradient) takes the C++ step where C++ is chosen ----
# (the recurrence itself, no chunk machinery: `mamba2_scan_step`); everything else the chunked
# Function of the chosen backend. The C++ kernel's sub-chunk (its BLAS product shape) is its own.


def _decode_step(x, cu_seqlens, grads: bool) -> bool:
    return x.shape[1] == 1 and cu_seqlens is None and not grads


# ---- The reference: plain autograd --------------------------------------------------------


def _recurrent(x, dt, A, B, C, state, spans_):
    """Token by token, per example: same contract as the chunked core."""
    out, finals = [], []
    for n, (s, e) in enumerate(spans_):
        h = state[n]  # (H, P, N)
        for t in range(s, e):
            dtt = dt[t][:, None, None]  # (H, 1, 1)
            h = h * (dtt * A[:, None, None]).exp() + dtt * x[t][..., None] * B[t][:, None, :]
            out.append((h * C[t][:, None, :]).sum(-1))  # (H, P)
        finals.append(h)
    y = torch.stack(out) if out else x.new_zeros(0, *x.shape[1:])
    return y, torch.stack(finals)


def _chunked(chunk):
    def core(x, dt, A, B, C, state, spans_):
        y, final, _ = forward_pass(x, dt, A, B, C, state, layout(spans_, x.shape[0], chunk,
                                                                  x.device))  # fmt: skip
        return y, final

    return core


def _run(core, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state,
         output_final_state, cu_seqlens):  # fmt: skip
    b, t, h, p = x.shape
    sp = spans(t, b, cu_seqlens)
    dtype = compute_dtype(x)
    _, dts = discretize(dt.reshape(-1, h), dt_bias, dt_softplus, *dt_limit, dtype)
    rep = h // B.shape[2]
    Bs, Cs = (v.reshape(-1, *v.shape[2:]).to(dtype).repeat_interleave(rep, dim=1) for v in (B, C))
    xs = x.reshape(-1, h, p).to(dtype)
    n = B.shape[-1]
    state = xs.new_zeros(len(sp), h, p, n) if initial_state is None else initial_state.to(dtype)
    y, final = core(xs, dts, A.to(dtype), Bs, Cs, state, sp)
    if D is not None:
        y = y + xs * D.to(dtype)[:, None]  # the skip reads x itself, not x * dt
    return y.view(b, t, h, p), final if output_final_state else None


def _check(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, chunk):
    if (
        not x.is_floating_point()
        or x.dim() != 4
        or dt.shape != x.shape[:3]
        or A.shape != (x.shape[2],)
    ):
        raise ValueError(
            f"mamba2_scan: x {tuple(x.shape)} {x.dtype} must be floating (B, T, H, P), dt "
            f"{tuple(dt.shape)} (B, T, H) and A {tuple(A.shape)} (H,)"
        )
    if B.dim() != 4 or B.shape != C.shape or B.shape[:2] != x.shape[:2] or x.shape[2] % B.shape[2]:
        raise ValueError(
            f"mamba2_scan: B {tuple(B.shape)} and C {tuple(C.shape)} must be (B, T, G, N) with the "
            f"heads H={x.shape[2]} a multiple of G"
        )
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None and v.shape != (x.shape[2],):
            raise ValueError(f"mamba2_scan: {name} {tuple(v.shape)} must be (H,) = ({x.shape[2]},)")
    if chunk < 1:
        raise ValueError(f"mamba2_scan: chunk_size must be >= 1, got {chunk}")
    n = x.shape[0]
    if cu_seqlens is not None:
        _check_cu(x, cu_seqlens)
        n = cu_seqlens.numel() - 1
    want = (n, x.shape[2], x.shape[3], B.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(
            f"mamba2_scan: initial_state {tuple(initial_state.shape)} must be (N, H, P, N_state) "
            f"= {want}"
        )
    devices = {t.device for t in (x, dt, A, B, C, D, dt_bias, initial_state) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"mamba2_scan: inputs on several devices: {sorted(map(str, devices))}")


def _check_cu(x, cu):
    """The boundaries' shape; their values too, except while torch.compile traces (reading them
    would break the graph; the kernels check them again)."""
    t = x.shape[1]
    if x.shape[0] != 1 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"mamba2_scan: cu_seqlens must be (N+1,) over one row (B=1), got B={x.shape[0]} and "
            f"cu_seqlens {tuple(cu.shape)}"
        )
    if custom_ops.active():
        return
    if cu[0] != 0 or cu[-1] != t:
        raise ValueError(
            f"mamba2_scan: cu_seqlens must run from 0 to T={t}, got "
            f"{cu.tolist() if cu.numel() < 20 else (int(cu[0]), int(cu[-1]))}"
        )
    if (cu[1:] < cu[:-1]).any():
        raise ValueError("mamba2_scan: cu_seqlens must not decrease")


def mamba2_scan_reference(
    x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, dt_limit=NO_LIMIT, chunk_size=CHUNK,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):  # fmt: skip
    """Chunked (SSD) form, per example, plain autograd: ``(y (B, T, H, P) fp32, final_state
    (N, H, P, N) or None)``."""
    _check(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, chunk_size)
    return _run(_chunked(chunk_size), x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit,
                initial_state, output_final_state, cu_seqlens)  # fmt: skip


def mamba2_scan_recurrent(
    x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, dt_limit=NO_LIMIT,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):  # fmt: skip
    """The recurrence itself, per example (fp64 inputs: the tests' oracle): same contract as
    :func:`mamba2_scan_reference`."""
    _check(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, 1)
    return _run(_recurrent, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state,
                output_final_state, cu_seqlens)  # fmt: skip


# ---- The autograd.Function -----------------------------------------------------------------


def _implementation(backend: str):
    if backend == "torch":
        return torch_forward, torch_backward
    return backends.compiled("mamba2_scan", backend, "forward", "backward")


class Mamba2ScanFunction(torch.autograd.Function):
    """(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, softplus, lo, hi, chunk, backend)
    -> (y, final); saves the inputs and the interior chunk start states."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, softplus, lo, hi,
                chunk, backend):  # fmt: skip
        fwd, _ = _implementation(backend)
        y, final, saved = fwd(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, softplus,
                              lo, hi, chunk)  # fmt: skip
        ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, saved)
        ctx.args = (softplus, lo, hi, chunk)
        ctx.backend = backend
        return y, final

    @staticmethod
    def backward(ctx, gy, gfinal):
        needs = tuple(ctx.needs_input_grad[:8])
        if not any(needs):
            return (None,) * 14
        *inputs, saved = ctx.saved_tensors
        _, bwd = _implementation(ctx.backend)
        grads = bwd(gy.contiguous(), gfinal, *inputs, saved, *ctx.args, needs)
        return (*grads, *(None,) * 6)


# ---- The entry point ----------------------------------------------------------------------


def _unsupported(x, B, C) -> str | None:
    if B.dtype != x.dtype or C.dtype != x.dtype:
        return f"x, B and C dtypes differ ({x.dtype}, {B.dtype}, {C.dtype})"
    return None


def mamba2_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT, chunk_size: int = CHUNK,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None, backend: str | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The op's entry point (see the module docstring for shapes and ``cu_seqlens``): the chunked
    Function of the chosen backend; one decoding token without gradients the recurrence (C++:
    ``mamba2_scan_step``)."""
    _check(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, chunk_size)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    chosen = backends.select("mamba2_scan", x.device, backend, unsupported=_unsupported(x, B, C))
    inputs = (x, dt, A, B, C, D, dt_bias, initial_state)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    if not custom_ops.active() and _decode_step(x, cu_seqlens, grads):
        if chosen == "torch":
            return mamba2_scan_recurrent(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit,
                                         initial_state, output_final_state)  # fmt: skip
        (step,) = backends.compiled("mamba2_scan", chosen, "step")
        y, final = step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, dt_bias, initial_state,
                        dt_softplus, lo, hi)  # fmt: skip
        return y[:, None], final if output_final_state else None
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.long).contiguous()
    args = (x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), D, dt_bias,
            initial_state, cu, bool(dt_softplus), lo, hi, int(chunk_size), chosen)  # fmt: skip
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        y, final, _saved = mamba2_scan_op(*args)
    else:
        y, final = Mamba2ScanFunction.apply(*args)
    return y, final if output_final_state else None


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::mamba2_scan", mutates_args=())
def mamba2_scan_op(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
    softplus: bool, lo: float, hi: float, chunk: int, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(y, final, saved)``: the backends' forward contract (``mamba2_scan_chunks``)."""
    fwd, _ = _implementation(backend)
    return tuple(fwd(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, softplus, lo, hi,
                     chunk))  # fmt: skip


@mamba2_scan_op.register_fake
def _(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, softplus, lo, hi, chunk, backend):
    b, t, h, p = x.shape
    n_ex = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dtype = compute_dtype(x)
    state = (h, p, B.shape[-1])
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty(n_ex, *state, dtype=dtype),
            x.new_empty(n_slots(b, t, chunk), *state, dtype=dtype))  # fmt: skip


@torch.library.custom_op("lorafuse::mamba2_scan_backward", mutates_args=())
def mamba2_scan_backward_op(
    gy: Tensor, gfinal: Tensor | None, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, saved: Tensor, softplus: bool, lo: float, hi: float, chunk: int,
    needs: list[bool], backend: str,
) -> list[Tensor]:  # fmt: skip
    """The 8 gradients (x, dt, A, B, C, D, dt_bias, initial_state); 0-size where not asked."""
    _, bwd = _implementation(backend)
    inputs = (x, dt, A, B, C, D, dt_bias, initial_state)
    grads = bwd(gy.contiguous(), gfinal, *inputs, cu_seqlens, saved, softplus, lo, hi, chunk,
                tuple(needs))  # fmt: skip
    return [custom_ops.grad_or_empty(g, x if i is None else i) for g, i in zip(grads, inputs)]


@mamba2_scan_backward_op.register_fake
def _(gy, gfinal, x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, saved, softplus, lo, hi,
      chunk, needs, backend):  # fmt: skip
    inputs = (x, dt, A, B, C, D, dt_bias, initial_state)
    return [i.new_empty(i.shape) if need and i is not None else x.new_empty(0)
            for i, need in zip(inputs, needs)]  # fmt: skip


def _scan_setup(ctx, inputs, output):
    *tensors, softplus, lo, hi, chunk, backend = inputs
    ctx.save_for_backward(*tensors, output[2])
    ctx.args = (softplus, lo, hi, chunk)
    ctx.backend = backend


def _scan_grad(ctx, gy, gfinal, _g_saved):
    needs = [bool(n) for n in ctx.needs_input_grad[:8]]
    if not any(needs):
        return (None,) * 14
    *inputs, cu, saved = ctx.saved_tensors
    grads = mamba2_scan_backward_op(gy, gfinal, *inputs, cu, saved, *ctx.args, needs,
                                    ctx.backend)  # fmt: skip
    return (*(g if n else None for g, n in zip(grads, needs)), *(None,) * 6)


mamba2_scan_op.register_autograd(_scan_grad, setup_context=_scan_setup)
