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
autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64  # transformers' chunk length; results do not depend on it beyond rounding


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


def _examples(t_total: int, batch: int, cu_seqlens: Tensor | None):
    """(row, start, end) of every example."""
    if cu_seqlens is None:
        return [(b, 0, t_total) for b in range(batch)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _run(one, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
    """Runs ``one`` (an example's (Hv, T, .) inputs and state -> (o, state)) on every example, in
    fp64 when the inputs are fp64 (the oracle), else fp32."""
    b, t, hv, dv = v.shape
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    out = torch.zeros(b, t, hv, dv, dtype=dt, device=v.device)
    finals = []
    for n, (row, s, e) in enumerate(_examples(t, b, cu_seqlens)):
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
        if b != 1 or cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != t:
            raise ValueError(
                f"gated_delta_rule: cu_seqlens must be (N+1,) from 0 to T={t} over one row "
                f"(B=1), got B={b} and {cu.tolist() if cu.numel() < 20 else tuple(cu.shape)}"
            )
        if (cu[1:] < cu[:-1]).any():
            raise ValueError("gated_delta_rule: cu_seqlens must not decrease")
        n = cu.numel() - 1
    if initial_state is not None and initial_state.shape != (n, v.shape[2], dk, v.shape[3]):
        raise ValueError(
            f"gated_delta_rule: initial_state {tuple(initial_state.shape)} must be (N, Hv, Dk, Dv)"
            f" = {(n, v.shape[2], dk, v.shape[3])}"
        )


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


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None, use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The op's entry point (see the module docstring for shapes and ``cu_seqlens``). Prefill and
    training run the chunked form; one token per sequence (T = 1, decoding) the recurrence."""
    if v.shape[1] == 1 and cu_seqlens is None:
        return gated_delta_rule_recurrent(
            q, k, v, g, beta, initial_state, output_final_state, None, use_qk_l2norm
        )
    return gated_delta_rule_reference(
        q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm
    )
