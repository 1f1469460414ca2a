"""The chunked SSD passes of :mod:`lorafuse.ops.mamba2_scan`: the layout of packed examples in
chunks, the forward (:func:`forward_pass`) and its hand-written backward (:func:`backward_pass`),
and the torch backend's contract (:func:`torch_forward`, :func:`torch_backward`) that
``csrc/mamba2_scan.cpp`` implements too.

Per chunk of C tokens of one example and one head, with ``acs`` the cumulative log decay
(``a_t = dt_t A``) inside the chunk, ``x̄ = dt x`` and start state ``S0`` (P, N):

    y_l   = sum_{s<=l} exp(acs_l - acs_s) (C_l . B_s) x̄_s + exp(acs_l) S0 C_l
    S_end = exp(acs_last) S0 + sum_s exp(acs_last - acs_s) x̄_s B_s^T

The backward runs the same products transposed, chunk by chunk from the last: the gradient of
each chunk's start state flows into the previous chunk's end. The gradient of ``acs`` collects
every exponent it appears in and becomes ``da`` by a reverse cumulative sum inside the chunk.

**What the backward needs**: the inputs and the start state of every chunk. The Function saves
the states at the interior chunk starts only (``k >= 1`` within each example; chunk 0 starts from
the initial state), in slots of a (``n_slots``, H, P, N) tensor whose size depends on shapes alone
(``B * ((T - 1) // chunk)``: torch.compile's fake implementation must know it), and recomputes
everything else (scores, decays): at Granite-4-like widths (chunk 256, P 64, N 128) the states are
a quarter of x's fp32 bytes per head, where autograd through the reference keeps the (C, C)
scores and decays of every chunk.

Why a file of its own: both paths of the op (its ``autograd.Function`` and the
``lorafuse::mamba2_scan`` custom op) run these passes, and the reference runs the forward; with
the op they would not fit one file. This module imports no op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp64 inputs compute in fp64 (the tests' oracle), everything else in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def spans(t: int, batch: int, cu_seqlens: Tensor | None) -> list[tuple[int, int]]:
    """(start, end) of every example over the flattened B * T tokens."""
    if cu_seqlens is None:
        return [(b * t, (b + 1) * t) for b in range(batch)]
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != t or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"mamba2_scan: cu_seqlens must run from 0 to T={t} without decreasing")
    return list(zip(cu[:-1], cu[1:]))


def n_slots(batch: int, t: int, chunk: int) -> int:
    """Rows of the saved interior states: at most ``(T - 1) // chunk`` per row, however the row
    is cut into examples (sum of ``ceil(len / chunk) - 1`` <= ``(sum len - 1) // chunk``)."""
    return batch * max(0, (t - 1) // chunk)


def slot_offsets(spans_: list[tuple[int, int]], chunk: int) -> list[int]:
    """The first slot of every example's interior states (its chunks 1, 2, ...)."""
    out, k = [], 0
    for s, e in spans_:
        out.append(k)
        k += max(0, -(-(e - s) // chunk) - 1)
    return out


def discretize(dt, dt_bias, softplus: bool, lo: float, hi: float, dtype) -> tuple[Tensor, Tensor]:
    """``(z, dt')`` over (T', H): ``z = dt + dt_bias`` in the compute dtype and
    ``dt' = clamp(softplus(z), lo, hi)``."""
    z = dt.to(dtype)
    if dt_bias is not None:
        z = z + dt_bias.to(dtype)
    v = F.softplus(z) if softplus else z
    return z, v.clamp(min=lo, max=hi)


def dt_chain(g: Tensor, z: Tensor, softplus: bool, lo: float, hi: float) -> Tensor:
    """d/dz of ``clamp(softplus(z), lo, hi)`` times ``g`` (torch's own rules: the clamp passes
    where lo <= v <= hi, softplus is linear above 20)."""
    v = F.softplus(z) if softplus else z
    g = torch.where((v >= lo) & (v <= hi), g, 0)
    if softplus:
        g = torch.ops.aten.softplus_backward(g, z, 1.0, 20.0)
    return g


def segsum(a: Tensor) -> Tensor:
    """(..., C) -> (..., C, C): ``sum(a[j+1..i])`` at [i, j] for j <= i, -inf above: transformers'
    ``segment_sum`` (a masked cumulative sum, stabler than differences of one cumulative sum)."""
    c = a.shape[-1]
    a = a[..., None].expand(*a.shape, c)  # (..., C, C): a[..., i, j] = a_i
    ones = torch.ones(c, c, dtype=torch.bool, device=a.device)
    s = a.masked_fill(~ones.tril(-1), 0).cumsum(-2)  # sum of a_k over j < k <= i
    return s.masked_fill(~ones.tril(), -math.inf)


@dataclass
class Layout:
    """Every example padded to whole chunks of ``chunk`` tokens: ``gather`` (NC*C,) token of each
    slot (``n_tokens``: a zero row), ``real`` (NC*C,) bool, ``n_chunks`` / ``first`` (N_ex,)."""

    chunk: int
    gather: Tensor
    real: Tensor
    n_chunks: Tensor
    first: Tensor

    def chunks(self, t: Tensor) -> Tensor:
        """(T', ...) -> (NC, C, ...); padded slots zero: no decay, no write."""
        t = torch.cat([t, t.new_zeros(1, *t.shape[1:])])[self.gather]
        return t.view(-1, self.chunk, *t.shape[1:])

    def tokens(self, t: Tensor) -> Tensor:
        """(NC, C, ...) -> (T', ...): the real slots."""
        return t.reshape(-1, *t.shape[2:])[self.real]


def layout(spans_, n_tokens: int, chunk: int, device) -> Layout:
    """The chunk shrinks to the next power of two of the longest example (a row of short packed
    examples is not padded to 256 tokens each; results change by rounding only). It shrinks only
    where every example fits one chunk, so interior states exist only at ``chunk`` itself."""
    longest = max((e - s for s, e in spans_), default=1)
    chunk = min(chunk, 1 << max(0, longest - 1).bit_length())
    parts, counts = [], []
    for s, e in spans_:
        n = -(-(e - s) // chunk)
        parts += [torch.arange(s, e), torch.full((n * chunk - (e - s),), n_tokens)]
        counts.append(n)
    gather = torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long)
    n_chunks = torch.tensor(counts, dtype=torch.long, device=device)
    return Layout(chunk, gather, gather < n_tokens, n_chunks, n_chunks.cumsum(0) - n_chunks)


def pass_states(chunk_states, chunk_decay, lay: Layout, state):
    """State at the start of every chunk, and each example's final state: all examples step
    together, one chunk index at a time. chunk_states (NC, H, P, N), chunk_decay (NC, H), state
    (N_ex, H, P, N)."""
    n_chunks = lay.n_chunks
    pieces, order = [], []
    for k in range(int(n_chunks.max()) if n_chunks.numel() else 0):
        act = (n_chunks > k).nonzero().squeeze(1)  # examples with a k-th chunk
        ids = lay.first[act] + k
        pieces.append(state[act])
        order.append(ids)
        new = state[act] * chunk_decay[ids][:, :, None, None] + chunk_states[ids]
        state = state.index_copy(0, act, new)  # out of place: autograd keeps every step
    if not pieces:
        return chunk_states.new_zeros(0, *state.shape[1:]), state
    starts = torch.cat(pieces)[torch.argsort(torch.cat(order))]  # (NC, H, P, N)
    return starts, state


def forward_pass(x, dt, A, B, C, state, lay: Layout):
    """SSD over the flattened tokens: x (T', H, P), dt (T', H) discretised, B, C (T', H, N),
    state (N_ex, H, P, N). Returns (y (T', H, P) without the D skip, final states, the start
    state of every chunk (NC, H, P, N))."""
    xdt = lay.chunks(x * dt[..., None])  # (NC, C, H, P)
    a = lay.chunks(dt * A).transpose(1, 2)  # (NC, H, C) log decay of each step
    Bc, Cc = lay.chunks(B), lay.chunks(C)  # (NC, C, H, N)
    acs = a.cumsum(-1)  # (NC, H, C)
    # Within each chunk: attention-like scores C_l . B_s, decayed from s to l.
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * segsum(a).exp()  # (NC, H, C, C)
    y = torch.einsum("chls,cshp->clhp", scores, xdt)  # (NC, C, H, P)
    # What each chunk adds to the state at its end, and the state passed between chunks.
    to_end = (acs[..., -1:] - acs).exp()  # (NC, H, C)
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", Bc, to_end, xdt)  # (NC, H, P, N)
    starts, final = pass_states(chunk_states, acs[..., -1].exp(), lay, state)
    y = y + torch.einsum("clhn,chpn->clhp", Cc, starts) * acs.exp().transpose(1, 2)[..., None]
    return lay.tokens(y), final, starts  # (T', H, P)


def _pass_grads(dstarts, decay, lay: Layout, g):
    """Reverse of :func:`pass_states`: the gradient of every chunk's end state (NC, H, P, N) and
    of the initial states (N_ex, H, P, N), from ``dstarts`` (what each start state gets from its
    own chunk's outputs) and ``g`` (the final states' gradient)."""
    dends = torch.empty_like(dstarts)
    n_chunks = lay.n_chunks
    for k in reversed(range(int(n_chunks.max()) if n_chunks.numel() else 0)):
        act = (n_chunks > k).nonzero().squeeze(1)
        ids = lay.first[act] + k
        dends[ids] = g[act]
        g[act] = dstarts[ids] + decay[ids][:, :, None, None] * g[act]
    return dends, g


def backward_pass(gy, gfinal, x, dt, A, B, C, starts, lay: Layout):
    """Gradients of :func:`forward_pass` (same shapes; ``gy`` (T', H, P), ``gfinal`` (N_ex, H, P,
    N) or None): ``(dx̄... ) = (dxdt (T', H, P), da (T', H), dB, dC (T', H, N), d initial
    state)`` where ``xdt = x * dt`` and ``a = dt * A``. Recomputes the scores and decays."""
    xdt = lay.chunks(x * dt[..., None])  # (NC, C, H, P)
    a = lay.chunks(dt * A).transpose(1, 2)  # (NC, H, C)
    Bc, Cc, gyc = lay.chunks(B), lay.chunks(C), lay.chunks(gy)
    acs = a.cumsum(-1)
    decay = segsum(a).exp()  # (NC, H, C, C)
    M = torch.einsum("clhn,cshn->chls", Cc, Bc) * decay
    # Within each chunk (y_l = sum_s M_ls x̄_s): x̄, the scores' C and B, and the exponents.
    dxdt = torch.einsum("chls,clhp->cshp", M, gyc)
    dM = torch.einsum("clhp,cshp->chls", gyc, xdt)
    q = dM * M  # d/d(acs_l - acs_s) of every term
    dacs = q.sum(-1) - q.sum(-2)  # (NC, H, C)
    dM = dM * decay
    dCc = torch.einsum("chls,cshn->clhn", dM, Bc)
    dBc = torch.einsum("chls,clhn->cshn", dM, Cc)
    # The start state's part of y: exp(acs_l) S0 C_l.
    eacs = acs.exp()  # (NC, H, C)
    gys = gyc * eacs.transpose(1, 2)[..., None]  # (NC, C, H, P)
    dCoff = torch.einsum("clhp,chpn->clhn", gys, starts)
    dacs = dacs + torch.einsum("clhn,clhn->chl", Cc, dCoff)
    dCc = dCc + dCoff
    dstarts = torch.einsum("clhp,clhn->chpn", gys, Cc)
    # Chunk to chunk, from the last: S_end = exp(acs_last) S0 + sum_s to_end_s x̄_s B_s^T.
    chunk_decay = eacs[..., -1]  # (NC, H)
    g0 = gfinal.clone() if gfinal is not None else starts.new_zeros(len(lay.n_chunks),
                                                                   *starts.shape[1:])  # fmt: skip
    dends, dinit = _pass_grads(dstarts, chunk_decay, lay, g0)
    dacs[..., -1] += torch.einsum("chpn,chpn->ch", dends, starts) * chunk_decay
    to_end = (acs[..., -1:] - acs).exp().transpose(1, 2)[..., None]  # (NC, C, H, 1)
    dBst = torch.einsum("clhp,chpn->clhn", xdt, dends)  # x̄_s^T dS_end
    t = torch.einsum("clhn,clhn->chl", Bc, dBst) * to_end[..., 0].transpose(1, 2)  # (NC, H, C)
    dacs = dacs - t
    dacs[..., -1] += t.sum(-1)
    dBc = dBc + dBst * to_end
    dxdt = dxdt + torch.einsum("clhn,chpn->clhp", Bc * to_end, dends)
    da = dacs.flip(-1).cumsum(-1).flip(-1).transpose(1, 2)  # (NC, C, H): reverse cumsum
    return lay.tokens(dxdt), lay.tokens(da), lay.tokens(dBc), lay.tokens(dCc), dinit


# ---- The torch backend's contract (csrc/mamba2_scan.cpp implements the same) ----------------


def _flat(x, dt, B, C, dtype):
    """x (T', H, P), dt (T', H), B, C (T', H, N) repeated to the heads, in the compute dtype."""
    h = x.shape[2]
    rep = h // B.shape[2]
    B, C = (v.reshape(-1, *v.shape[2:]).to(dtype).repeat_interleave(rep, dim=1) for v in (B, C))
    return x.reshape(-1, *x.shape[2:]).to(dtype), dt.reshape(-1, h), B, C


def torch_forward(x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, softplus, lo, hi,
                  chunk):  # fmt: skip
    """``(y (B, T, H, P), final (N_ex, H, P, N), saved (n_slots, H, P, N))`` in the compute
    dtype; ``saved`` holds the interior chunk start states (module docstring)."""
    b, t, h, p = x.shape
    dtype = compute_dtype(x)
    sp = spans(t, b, cu_seqlens)
    xs, dt_, Bs, Cs = _flat(x, dt, B, C, dtype)
    _, dts = discretize(dt_, dt_bias, softplus, lo, hi, dtype)
    n = B.shape[-1]
    state = (xs.new_zeros(len(sp), h, p, n) if initial_state is None
             else initial_state.to(dtype, copy=True))  # fmt: skip
    lay = layout(sp, xs.shape[0], chunk, xs.device)
    y, final, starts = forward_pass(xs, dts, A.to(dtype), Bs, Cs, state, lay)
    if D is not None:
        y = y + xs * D.to(dtype)[:, None]  # the skip reads x itself, not x * dt
    saved = xs.new_zeros(n_slots(b, t, chunk), h, p, n)
    if lay.chunk == chunk and saved.shape[0]:  # interior starts exist only at the full chunk
        k = torch.arange(starts.shape[0], device=xs.device)
        owner = torch.repeat_interleave(torch.arange(len(sp), device=xs.device), lay.n_chunks)
        inner = k - lay.first[owner]  # chunk index within its example
        off = torch.tensor(slot_offsets(sp, chunk), device=xs.device)[owner] + inner - 1
        saved[off[inner > 0]] = starts[inner > 0]
    return y.view(b, t, h, p), final, saved


def _starts(saved, initial_state, lay: Layout, sp, chunk, shape, dtype):
    """Every chunk's start state (NC, H, P, N) from the initial states and the saved slots."""
    n_ex = len(sp)
    init = (saved.new_zeros(n_ex, *shape) if initial_state is None
            else initial_state.to(dtype))  # fmt: skip
    owner = torch.repeat_interleave(torch.arange(n_ex, device=saved.device), lay.n_chunks)
    inner = torch.arange(owner.numel(), device=saved.device) - lay.first[owner]
    off = torch.tensor(slot_offsets(sp, chunk), device=saved.device)[owner] + inner - 1
    src = torch.where(inner > 0, off + n_ex, owner)  # rows of cat([init, saved])
    return torch.cat([init, saved])[src]


def torch_backward(gy, gfinal, x, dt, A, B, C, D, dt_bias, initial_state, cu_seqlens, saved,
                   softplus, lo, hi, chunk, needs):  # fmt: skip
    """``(dx, ddt, dA, dB, dC, dD, ddt_bias, dinitial_state)``, each in its input's dtype, None
    unless ``needs`` (8 bools, in that order) asks for it."""
    b, t, h, p = x.shape
    dtype = compute_dtype(x)
    sp = spans(t, b, cu_seqlens)
    xs, dt_, Bs, Cs = _flat(x, dt, B, C, dtype)
    z, dts = discretize(dt_, dt_bias, softplus, lo, hi, dtype)
    A_ = A.to(dtype)
    lay = layout(sp, xs.shape[0], chunk, xs.device)
    starts = _starts(saved, initial_state, lay, sp, chunk, (h, p, B.shape[-1]), dtype)
    g = gy.reshape(-1, h, p).to(dtype)
    gf = gfinal.to(dtype) if gfinal is not None else None
    dxdt, da, dB, dC, dinit = backward_pass(g, gf, xs, dts, A_, Bs, Cs, starts, lay)
    ddt = A_ * da + (xs * dxdt).sum(-1)  # (T', H): a = dt A, x̄ = dt x
    dz = dt_chain(ddt, z, softplus, lo, hi)
    dx = dts[..., None] * dxdt
    if D is not None:
        dx = dx + g * D.to(dtype)[:, None]
    grp = B.shape[2]
    out = (
        dx.view(x.shape),
        dz.view(dt.shape),
        (dts * da).sum(0),
        dB.view(b * t, grp, h // grp, -1).sum(2).view(B.shape),
        dC.view(b * t, grp, h // grp, -1).sum(2).view(C.shape),
        (g * xs).sum((0, 2)) if D is not None else None,
        dz.sum(0) if dt_bias is not None else None,
        dinit if initial_state is not None else None,
    )
    like = (x, dt, A, B, C, D, dt_bias, initial_state)
    return tuple(v.to(i.dtype) if n and v is not None else None
                 for v, n, i in zip(out, needs, like))  # fmt: skip
