"""Mamba2's selective state-space scan (SSD: Granite 4's mamba layers), per packed example.

Per head h, with the state ``S`` (P, N) running along the sequence:

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)      (bias and softplus optional)
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,           y_t = S_t C_t + D_h x_t

Shapes: x (B, T, H, P); dt (B, T, H); A (H,) (negative: ``-exp(A_log)``); B, C (B, T, G, N) with
H a multiple of G (each group serves H / G consecutive heads, as transformers repeats them); D and
dt_bias (H,) or None. Output y (B, T, H, P) in fp32, as transformers' torch scan returns it (the
gated norm after it reads fp32); states (N_ex, H, P, N) in fp32. fp64 inputs compute in fp64 (the
tests' oracle).

Examples: without ``cu_seqlens`` each batch row is one sequence (N_ex = B). With ``cu_seqlens``
(int64 (N_ex+1,), cumulative example boundaries over one row's T tokens, B = 1, FLA's varlen
convention) the state restarts at every boundary from ``initial_state[n]`` or zeros.

:func:`mamba2_scan_reference` is the chunked (SSD) form transformers' ``mamba2_chunk_scan`` /
``Mamba2Mixer.torch_forward`` computes: every example is padded to whole chunks of its own (padded
steps neither decay nor write), the within-chunk products run for all chunks of all examples at
once, and the chunk-to-chunk state passing steps all examples together, one chunk index at a time
(the chunk shrinks to the next power of two of the longest example: a row of short packed
examples is not padded to 256 tokens per example).
:func:`mamba2_scan_recurrent` is the token-by-token recurrence (the decoding step; in fp64 the
oracle). Both are plain autograd: backward recomputes nothing and saves what autograd saves.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 256  # Mamba2's / Granite 4's default chunk length; results depend on it only by rounding
NO_LIMIT = (0.0, math.inf)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prepare(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit):
    """(T', .) flattened tokens in the compute dtype: x (T', H, P), dt (T', H) discretised,
    B, C (T', H, N) repeated to the heads."""
    dtype = _compute_dtype(x)
    h = x.shape[2]
    dt = dt.reshape(-1, h).to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    rep = h // B.shape[2]
    B, C = (y.reshape(-1, *y.shape[2:]).to(dtype).repeat_interleave(rep, dim=1) for y in (B, C))
    return x.reshape(-1, *x.shape[2:]).to(dtype), dt, A.to(dtype), B, C


def _examples(t: int, batch: int, cu_seqlens: Tensor | None) -> list[tuple[int, int]]:
    """(start, end) of every example over the flattened B * T tokens."""
    if cu_seqlens is None:
        return [(b * t, (b + 1) * t) for b in range(batch)]
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _segsum(a: Tensor) -> Tensor:
    """(..., C) -> (..., C, C): ``sum(a[j+1..i])`` at [i, j] for j <= i, -inf above: transformers'
    ``segment_sum`` (a masked cumulative sum, stabler than differences of one cumulative sum)."""
    c = a.shape[-1]
    a = a[..., None].expand(*a.shape, c)  # (..., C, C): a[..., i, j] = a_i
    ones = torch.ones(c, c, dtype=torch.bool, device=a.device)
    s = a.masked_fill(~ones.tril(-1), 0).cumsum(-2)  # sum of a_k over j < k <= i
    return s.masked_fill(~ones.tril(), -math.inf)


def _chunk_layout(spans, n_tokens: int, chunk: int, device):
    """Slots of every example padded to whole chunks: ``(gather (NC*C,), real (NC*C,) bool,
    n_chunks (N_ex,))``; padded slots read row ``n_tokens`` (zeros)."""
    parts, counts = [], []
    for s, e in spans:
        n = -(-(e - s) // chunk)
        parts += [torch.arange(s, e), torch.full((n * chunk - (e - s),), n_tokens)]
        counts.append(n)
    gather = torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long)
    return gather, gather < n_tokens, torch.tensor(counts, device=device)


def _pass_states(chunk_states, chunk_decay, n_chunks, state):
    """State at the start of every chunk, and each example's final state: all examples step
    together, one chunk index at a time. chunk_states (NC, H, P, N), chunk_decay (NC, H), state
    (N_ex, H, P, N)."""
    first = n_chunks.cumsum(0) - n_chunks  # (N_ex,) index of each example's first chunk
    pieces, order = [], []
    for k in range(int(n_chunks.max()) if n_chunks.numel() else 0):
        act = (n_chunks > k).nonzero().squeeze(1)  # examples with a k-th chunk
        ids = first[act] + k
        pieces.append(state[act])
        order.append(ids)
        new = state[act] * chunk_decay[ids][:, :, None, None] + chunk_states[ids]
        state = state.index_copy(0, act, new)  # out of place: autograd keeps every step
    if not pieces:
        return chunk_states.new_zeros(0, *state.shape[1:]), state
    starts = torch.cat(pieces)[torch.argsort(torch.cat(order))]  # (NC, H, P, N)
    return starts, state


def _chunked(x, dt, A, B, C, state, spans, chunk):
    """SSD over the flattened tokens: x (T', H, P), dt (T', H), B, C (T', H, N), spans (start,
    end) of each example, state (N_ex, H, P, N). Returns (y (T', H, P) without the D skip, final
    states)."""
    n_tok = x.shape[0]
    longest = max((e - s for s, e in spans), default=1)
    # Each example is padded to whole chunks: rows of short packed examples take a shorter chunk
    # (the longest example's next power of two). It changes the rounding only.
    chunk = min(chunk, 1 << max(0, longest - 1).bit_length())
    gather, real, n_chunks = _chunk_layout(spans, n_tok, chunk, x.device)

    def chunks(t):  # (T', ...) -> (NC, C, ...), padded slots zero: no decay, no write
        return torch.cat([t, t.new_zeros(1, *t.shape[1:])])[gather].view(-1, chunk, *t.shape[1:])

    xdt = chunks(x * dt[..., None])  # (NC, C, H, P)
    a = chunks(dt * A).transpose(1, 2)  # (NC, H, C) log decay of each step
    Bc, Cc = chunks(B), chunks(C)  # (NC, C, H, N)
    acs = a.cumsum(-1)  # (NC, H, C)
    # Within each chunk: attention-like scores C_l . B_s, decayed from s to l.
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * _segsum(a).exp()  # (NC, H, C, C)
    y = torch.einsum("chls,cshp->clhp", scores, xdt)  # (NC, C, H, P)
    # What each chunk adds to the state at its end, and the state passed between chunks.
    to_end = (acs[..., -1:] - acs).exp()  # (NC, H, C)
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", Bc, to_end, xdt)  # (NC, H, P, N)
    starts, final = _pass_states(chunk_states, acs[..., -1].exp(), n_chunks, state)
    y = y + torch.einsum("clhn,chpn->clhp", Cc, starts) * acs.exp().transpose(1, 2)[..., None]
    return y.reshape(-1, *y.shape[2:])[real], final  # (T', H, P)


def _recurrent(x, dt, A, B, C, state, spans):
    """Token by token, per example: same contract as :func:`_chunked`."""
    out, finals = [], []
    for n, (s, e) in enumerate(spans):
        h = state[n]  # (H, P, N)
        for t in range(s, e):
            dtt = dt[t][:, None, None]  # (H, 1, 1)
            h = h * (dtt * A[:, None, None]).exp() + dtt * x[t][..., None] * B[t][:, None, :]
            out.append((h * C[t][:, None, :]).sum(-1))  # (H, P)
        finals.append(h)
    y = torch.stack(out) if out else x.new_zeros(0, *x.shape[1:])
    return y, torch.stack(finals)


def _run(core, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state,
         output_final_state, cu_seqlens):  # fmt: skip
    b, t, h, p = x.shape
    spans = _examples(t, b, cu_seqlens)
    xs, dts, A_, Bs, Cs = _prepare(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    n = B.shape[-1]
    if initial_state is None:
        state = xs.new_zeros(len(spans), h, p, n)
    else:
        state = initial_state.to(xs.dtype)
    y, final = core(xs, dts, A_, Bs, Cs, state, spans)
    if D is not None:
        y = y + xs * D.to(xs.dtype)[:, None]  # the skip reads x itself, not x * dt
    return y.view(b, t, h, p), final if output_final_state else None


def _check(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, chunk):
    if x.dim() != 4 or dt.shape != x.shape[:3] or A.shape != (x.shape[2],):
        raise ValueError(
            f"mamba2_scan: x {tuple(x.shape)} must be (B, T, H, P), dt {tuple(dt.shape)} (B, T, H) "
            f"and A {tuple(A.shape)} (H,)"
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
        cu, t = cu_seqlens, x.shape[1]
        if x.shape[0] != 1 or cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != t:
            raise ValueError(
                f"mamba2_scan: cu_seqlens must be (N+1,) from 0 to T={t} over one row (B=1), got "
                f"B={x.shape[0]} and {cu.tolist() if cu.numel() < 20 else tuple(cu.shape)}"
            )
        if (cu[1:] < cu[:-1]).any():
            raise ValueError("mamba2_scan: cu_seqlens must not decrease")
        n = cu.numel() - 1
    want = (n, x.shape[2], x.shape[3], B.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(
            f"mamba2_scan: initial_state {tuple(initial_state.shape)} must be (N, H, P, N_state) "
            f"= {want}"
        )


def mamba2_scan_reference(
    x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, dt_limit=NO_LIMIT, chunk_size=CHUNK,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):  # fmt: skip
    """Chunked (SSD) form, per example: ``(y (B, T, H, P) fp32, final_state (N, H, P, N) or
    None)``."""
    _check(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, chunk_size)

    def core(*args):
        return _chunked(*args, chunk_size)

    return _run(core, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state,
                output_final_state, cu_seqlens)  # fmt: skip


def mamba2_scan_recurrent(
    x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, dt_limit=NO_LIMIT,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):  # fmt: skip
    """The recurrence itself, per example (fp64 inputs: the tests' oracle): same contract as
    :func:`mamba2_scan_reference`."""
    _check(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, 1)
    return _run(_recurrent, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state,
                output_final_state, cu_seqlens)  # fmt: skip


def mamba2_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT, chunk_size: int = CHUNK,
    initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The op's entry point (see the module docstring for shapes and ``cu_seqlens``). Prefill and
    training run the chunked form; one token per sequence (T = 1, decoding) the recurrence."""
    if x.shape[1] == 1 and cu_seqlens is None:
        return mamba2_scan_recurrent(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit,
                                     initial_state, output_final_state)  # fmt: skip
    return mamba2_scan_reference(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, chunk_size,
                                 initial_state, output_final_state, cu_seqlens)  # fmt: skip
