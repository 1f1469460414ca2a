"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next), per packed example.

Per value head, with L2-normalised ``q``/``k`` (``use_qk_l2norm``) and ``q`` scaled by
``Dk ** -0.5``, the state ``S`` (Dk, Dv) runs along the sequence:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

Shapes: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv) with Hv a multiple of Hk (each q/k head serves
Hv / Hk consecutive value heads, as transformers repeats them); g, beta (B, T, Hv) (g <= 0, the
log decay). Output (B, T, Hv, Dv) in v's dtype; states (N, Hv, Dk, Dv) in fp32.

Examples: without ``cu_seqlens`` each batch row is one sequence (N = B). With ``cu_seqlens``
(int64 (N+1,), cumulative example boundaries over the T tokens of a single row, B = 1, as
flash-linear-attention's varlen API takes them) the state restarts at every boundary, from
``initial_state[n]`` or zeros: packed examples never see each other.

:func:`gated_delta_rule_reference` is the chunked (WY / UT-transform) form transformers'
``torch_chunk_gated_delta_rule`` computes, run per example; :func:`gated_delta_rule_recurrent` is
the token-by-token recurrence (the decoding step, and in fp64 the tests' oracle). Both are plain
autograd, the oracles of :class:`GatedDeltaFunction`.

:class:`GatedDeltaFunction`: the same chunked form with a hand-written backward (the WY / UT
transform's, as flash-linear-attention derives it; the math in ``ops/gated_delta_chunks.py``).
Internal math fp32 (fp64 for fp64 inputs, torch backend only). Saved for backward: the inputs as
given (q, k, v, g, beta, initial_state, cu_seqlens) and the state at the start of every chunk
(fp32 (NCH, Hv, Dk, Dv), NCH <= Σ⌈T_n/64⌉ + N). The backward's reverse pass over the chunks needs
each chunk's start state; recomputing them would rerun the forward's one sequential part (the
state recurrence, parallel over (example, head) alone) inside the backward. They cost Dk·Dv/64
fp32 values per token and value head: 256 at Qwen3.5's Dk = Dv = 128, against 384 for that
token's q, k and v. The L2 norms, decays, the triangular solve and U, W, V' are recomputed per
chunk. Gradients for q, k, v, g, beta and initial_state, each only where asked for.

Backends (chosen in :mod:`lorafuse.backends`): ``torch`` (``ops/gated_delta_chunks.py``),
``cpp`` (``csrc/gated_delta.cpp``: ``gated_delta_forward`` / ``gated_delta_backward``),
``triton`` (``triton/gated_delta.py``: ``forward`` only, see there). Under ``torch.compile``
(end of this file): ``lorafuse::gated_delta`` and ``lorafuse::gated_delta_backward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import autocast, custom_ops
from lorafuse.ops import gated_delta_chunks as chunks

CHUNK = chunks.CHUNK  # transformers' chunk length; results do not depend on it beyond rounding

# ---- Policy: decoding's recurrence without autograd; fp64 and Triton gradients on torch ------
# Without gradients (prefill, decoding) the backend's forward runs alone, saving nothing; one token
# per sequence on the torch backend is the batched recurrence step (_decode_step: ~10 small ops
# against the chunked form's ~40). The compiled kernels compute in fp32: fp64 inputs (the
# oracle's dtype) run torch. Triton has no backward: a call asking for a gradient runs torch.


def _unsupported(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    if v.dtype == torch.float64:
        return "float64 inputs (the kernels compute in fp32)"
    if not q.dtype == k.dtype == v.dtype:
        return f"q, k, v of different dtypes ({q.dtype}, {k.dtype}, {v.dtype})"
    return None


_TRITON_NO_GRAD = "a gradient (the Triton kernels are forward and decoding only)"


def _decode_step(q, k, v, g, beta, initial_state, l2norm):
    """One token per row (T = 1, no cu_seqlens), batched over (B, Hv): (o, final state)."""
    b, _, hv, dv = v.shape
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    qn, _ = chunks.normalised(q[:, 0:1], hv, l2norm, dt)
    kn, _ = chunks.normalised(k[:, 0:1], hv, l2norm, dt)
    qn, kn = qn[:, 0] * q.shape[-1] ** -0.5, kn[:, 0]  # (B, Hv, Dk)
    state = v.new_zeros(b, hv, k.shape[-1], dv, dtype=dt)
    if initial_state is not None:
        state.copy_(initial_state)
    state *= g[:, 0].to(dt).exp()[..., None, None]
    delta = (v[:, 0].to(dt) - (kn.unsqueeze(-2) @ state).squeeze(-2)) * beta[:, 0, :, None].to(dt)
    state += kn.unsqueeze(-1) * delta.unsqueeze(-2)  # (B, Hv, Dk, Dv)
    o = (qn.unsqueeze(-2) @ state).squeeze(-2)  # (B, Hv, Dv)
    return o.unsqueeze(1).to(v.dtype), state


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # FLA's / transformers' eps


def _prepare(q, k, v, g, beta, use_qk_l2norm, dtype):
    """(H, T, .) views of one example in ``dtype``: q/k repeated to the value heads, normalised,
    scaled."""
    rep = v.shape[1] // k.shape[1]
    q, k = (x.repeat_interleave(rep, dim=1) if rep > 1 else x for x in (q, k))  # (T, Hv, Dk)
    q, k, v, g, beta = (x.transpose(0, 1).to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta  # (Hv, T, Dk), (Hv, T, Dk), (Hv, T, Dv), (Hv, T)


def _chunked_one(q, k, v, g, beta, state, chunk):
    """One example, (Hv, T, .) fp32 inputs and state (Hv, Dk, Dv): returns (o (Hv, T, Dv), state)."""
    t = q.shape[1]
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))  # (Hv, T', .)
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))  # padded steps: no decay, no write
    h, n = q.shape[0], q.shape[1] // chunk
    q, k, v = (x.reshape(h, n, chunk, -1) for x in (q, k, v))  # (Hv, n, C, .)
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # (Hv, n, C) log decay from the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # (Hv, n, C, C), unit lower triangular + I
    system = system.tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )  # (Hv, n, C, Dk)
    attn = (q @ k.transpose(-1, -2)) * decay  # (Hv, n, C, C) within-chunk reads
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    out = []
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state  # (Hv, C, Dv): what the old state does not predict
        out.append(q_dec[:, i] @ state + attn[:, i] @ v_new)
        state = state * cum[:, i, -1].exp()[:, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    o = torch.cat(out, dim=1)[:, :t]  # (Hv, T, Dv)
    return o, state


def _run(one, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
    """Runs ``one`` (an example's (Hv, T, .) inputs and state -> (o, state)) on every example, in
    fp64 when the inputs are fp64 (the oracle), else fp32."""
    b, t, hv, dv = v.shape
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    out = torch.zeros(b, t, hv, dv, dtype=dt, device=v.device)
    finals = []
    for n, (row, s, e) in enumerate(chunks.examples(b, t, cu_seqlens)):
        if initial_state is None:
            state = torch.zeros(hv, k.shape[-1], dv, dtype=dt, device=v.device)
        else:
            state = initial_state[n].to(dt)
        parts = (x[row, s:e] for x in (q, k, v, g, beta))
        o, state = one(*_prepare(*parts, use_qk_l2norm, dt), state)
        out[row, s:e] = o.transpose(0, 1)  # (T_n, Hv, Dv)
        finals.append(state)
    final = torch.stack(finals) if output_final_state else None
    return out.to(v.dtype), final


def gated_delta_rule_reference(
    q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm=True, chunk=CHUNK,
):  # fmt: skip
    """Chunked form, per example: ``(o (B, T, Hv, Dv), final_state (N, Hv, Dk, Dv) or None)``."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens)

    def step(q, k, v, g, beta, state):
        return _chunked_one(q, k, v, g, beta, state, chunk)

    return _run(
        step, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm
    )


def _recurrent_one(q, k, v, g, beta, state):
    """Token by token: (Hv, T, .) inputs, state (Hv, Dk, Dv)."""
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]  # (Hv, Dk, Dv)
        kt = k[:, t]  # (Hv, Dk)
        delta = (v[:, t] - (state * kt[..., None]).sum(-2)) * beta[:, t, None]  # (Hv, Dv)
        state = state + kt[..., None] * delta[:, None, :]
        out.append((state * q[:, t, :, None]).sum(-2))
    return torch.stack(out, dim=1), state


def gated_delta_rule_recurrent(
    q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm=True,
):  # fmt: skip
    """The recurrence itself, per example (fp64 inputs: the tests' oracle; else fp32): same
    contract as :func:`gated_delta_rule_reference`."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    return _run(
        _recurrent_one, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm,
    )  # fmt: skip


def _implementation(backend: str):
    """``(forward, backward)`` of ``backend`` (backward None for Triton: forward-only kernels)."""
    if backend == "torch":
        return chunks.forward, chunks.backward
    if backend == "triton":
        return backends.compiled("gated_delta", backend, "forward")[0], None
    return backends.compiled("gated_delta", backend, "forward", "backward")


class GatedDeltaFunction(torch.autograd.Function):
    """The chunked rule with its hand-written backward: ``(o, final_state)``, every backend."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, l2norm, backend):
        needs = tuple(ctx.needs_input_grad[:6])
        fwd, _ = _implementation(backend)
        o, final, states = fwd(q, k, v, g, beta, initial_state, cu_seqlens, l2norm, any(needs))
        ctx.save_for_backward(q, k, v, g, beta, initial_state, states, cu_seqlens)
        ctx.l2norm, ctx.backend = l2norm, backend
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        needs = tuple(ctx.needs_input_grad[:6])
        if not any(needs) or (do is None and dfinal is None):
            return (None,) * 9
        q, k, v, g, beta, initial_state, states, cu_seqlens = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do.contiguous()
        _, bwd = _implementation(ctx.backend)
        with autocast.disabled(v.device):  # fp32 math whatever the caller's autocast state
            grads = bwd(do, dfinal, q, k, v, g, beta, initial_state, states, cu_seqlens,
                        ctx.l2norm, needs)  # fmt: skip
        return (*(d if need else None for d, need in zip(grads, needs)), None, None, None)


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    b, t, hk, dk = k.shape
    if q.shape != k.shape or v.dim() != 4 or v.shape[:2] != (b, t) or v.shape[2] % hk:
        raise ValueError(
            f"gated_delta_rule: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, T, Hk, Dk) "
            f"and v {tuple(v.shape)} (B, T, Hv, Dv) with Hv a multiple of Hk"
        )
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(
            f"gated_delta_rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be (B, T, Hv) "
            f"= {tuple(v.shape[:3])}"
        )
    n = b
    if cu_seqlens is not None:
        cu = cu_seqlens
        # values only in eager: under torch.compile they would break the graph (the kernels check)
        values = not custom_ops.active()
        if b != 1 or cu.dim() != 1 or cu.numel() < 2 or (values and (cu[0] != 0 or cu[-1] != t)):
            raise ValueError(
                f"gated_delta_rule: cu_seqlens must be (N+1,) from 0 to T={t} over one row "
                f"(B=1), got B={b} and {cu.tolist() if cu.numel() < 20 else tuple(cu.shape)}"
            )
        if values and (cu[1:] < cu[:-1]).any():
            raise ValueError("gated_delta_rule: cu_seqlens must not decrease")
        n = cu.numel() - 1
    if initial_state is not None and initial_state.shape != (n, v.shape[2], dk, v.shape[3]):
        raise ValueError(
            f"gated_delta_rule: initial_state {tuple(initial_state.shape)} must be (N, Hv, Dk, Dv)"
            f" = {(n, v.shape[2], dk, v.shape[3])}"
        )


def _check_tensors(q, k, v, g, beta, initial_state, cu_seqlens):
    """dtypes and devices (the shapes: :func:`_check`)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                    ("initial_state", initial_state)):  # fmt: skip
        if t is None:
            continue
        if not t.is_floating_point():
            raise ValueError(f"gated_delta_rule: {name} must be floating point, got {t.dtype}")
        if t.device != v.device:
            raise ValueError(f"gated_delta_rule: {name} on {t.device}, v on {v.device}")
    if cu_seqlens is not None and (cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(
            f"gated_delta_rule: cu_seqlens must be int32/int64, got {cu_seqlens.dtype}"
        )


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None, use_qk_l2norm: bool = True, backend: str | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The op's entry point (see the module docstring for shapes and ``cu_seqlens``): the chunked
    form with its own backward where a gradient is asked for, the backend's forward alone where
    not (prefill, decoding: the recurrence for one token a row)."""
    _check_tensors(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=v.device, dtype=torch.int64)
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    ins = (q, k, v, g, beta, initial_state)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ins)
    chosen = backends.select("gated_delta", v.device, backend, unsupported=_unsupported(q, k, v))
    if chosen == "triton" and grad:  # recorded, with one warning
        chosen = backends.select("gated_delta", v.device, backend, unsupported=_TRITON_NO_GRAD)
    with autocast.disabled(v.device):  # fp32 math (the model's own upcast) under autocast too
        if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
            o, final, _ = gated_delta_op(*ins, cu_seqlens, use_qk_l2norm, grad, chosen)
        elif grad:
            o, final = GatedDeltaFunction.apply(*ins, cu_seqlens, use_qk_l2norm, chosen)
        elif chosen == "torch" and v.shape[1] == 1 and cu_seqlens is None:
            o, final = _decode_step(q, k, v, g, beta, initial_state, use_qk_l2norm)
        else:
            o, final, _ = _implementation(chosen)[0](*ins, cu_seqlens, use_qk_l2norm, False)
    return o, (final if output_final_state else None)


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::gated_delta", mutates_args=())
def gated_delta_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, l2norm: bool, save_states: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(o, final_state, states)``: the backends' forward contract."""
    fwd, _ = _implementation(backend)
    return tuple(fwd(q, k, v, g, beta, initial_state, cu_seqlens, l2norm, save_states))


@gated_delta_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, l2norm, save_states, backend):
    b, t, hv, dv = v.shape
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    rows = chunks.max_chunks(b, t, n, cu_seqlens is not None) if save_states else 0
    states = v.new_empty(rows, hv, k.shape[-1], dv, dtype=dt)
    return v.new_empty(v.shape), v.new_empty(n, hv, k.shape[-1], dv, dtype=dt), states


@torch.library.custom_op("lorafuse::gated_delta_backward", mutates_args=())
def gated_delta_backward_op(
    do: Tensor, dfinal: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Tensor | None, states: Tensor, cu_seqlens: Tensor | None, l2norm: bool,
    needs: list[bool], backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv, dg, dbeta, dinitial_state)``; each 0-size unless asked for in ``needs``."""
    _, bwd = _implementation(backend)
    grads = bwd(do.contiguous(), dfinal, q, k, v, g, beta, initial_state, states, cu_seqlens,
                l2norm, tuple(needs))  # fmt: skip
    likes = (q, k, v, g, beta, initial_state if initial_state is not None else v)
    return tuple(custom_ops.grad_or_empty(d if need else None, like)
                 for d, need, like in zip(grads, needs, likes))  # fmt: skip


@gated_delta_backward_op.register_fake
def _(do, dfinal, q, k, v, g, beta, initial_state, states, cu_seqlens, l2norm, needs, backend):
    likes = (q, k, v, g, beta, initial_state if initial_state is not None else v)
    return tuple(x.new_empty(x.shape) if need else x.new_empty(0) for x, need in zip(likes, needs))


def _gated_delta_setup(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, l2norm, _save, backend = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, output[2], cu_seqlens)
    ctx.l2norm, ctx.backend = l2norm, backend


def _gated_delta_grad(ctx, do, dfinal, _dstates):
    needs = [bool(x) for x in ctx.needs_input_grad[:6]]
    if not any(needs):
        return (None,) * 10
    q, k, v, g, beta, initial_state, states, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    grads = gated_delta_backward_op(do, dfinal, q, k, v, g, beta, initial_state, states,
                                    cu_seqlens, ctx.l2norm, needs, ctx.backend)  # fmt: skip
    return (*(d if need else None for d, need in zip(grads, needs)), None, None, None, None)


gated_delta_op.register_autograd(_gated_delta_grad, setup_context=_gated_delta_setup)
