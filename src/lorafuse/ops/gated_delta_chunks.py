"""The gated delta rule's torch backend: the chunked (WY / UT-transform) forward and its
hand-written backward, batched over every chunk of every example and head.

Held apart from ``ops/gated_delta.py`` (which imports it) because both its eager
``autograd.Function`` and its custom op run these two functions. Never imports the op back.

Per chunk of C tokens (γ the cumulative log decay from the chunk start, e = exp(γ), f = exp(γ_L -
γ), D_ts = exp(γ_t - γ_s) for s <= t, S0 the state at the chunk start):

    M = tril(diag(β) K Kᵀ ⊙ D, -1)      (I + M) [U | W] = [diag(β) V | diag(β e) K]
    V' = U - W S0                       O = diag(e) Q S0 + (Q Kᵀ ⊙ D) V'
    S_end = e_L S0 + (diag(f) K)ᵀ V'

Backward per chunk, dS the gradient of S_end (carried from the next chunk; the recurrence in
reverse is the only sequential part): dV' = Pᵀ dO + diag(f) K dS; dS0 = (diag(e) Q)ᵀ dO + e_L dS
- Wᵀ dV'; then, chunk-local, dQ, dK through P and the state reads, [dVb | dKbg] = (I + M)⁻ᵀ [dV' |
-dV' S0ᵀ], dM = -(dVb Uᵀ + dKbg Wᵀ); dγ_t collects the e_t and f_t terms and each strictly lower
pair's dP ⊙ P and dM ⊙ M (+ at t, - at s), dg its reverse cumulative sum.

Chunks are laid out step-major (:class:`Layout`): the j-th chunks of all examples that have one
sit side by side, examples ordered longest first, so the recurrence's step j updates a prefix of
the (N, H, Dk, Dv) state tensor. Padding (the last chunk of an example shorter than C) has g = 0,
β = 0 and zero q, k, v: it leaves the state and every real position unchanged.

Saved between forward and backward: the state at the start of every chunk (``states``, fp32,
(NCH, Hv, Dk, Dv) with NCH <= :func:`max_chunks`); everything else is recomputed chunk-locally.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 64  # transformers' and FLA's chunk length


def max_chunks(b: int, t: int, n: int, varlen: bool, chunk: int = CHUNK) -> int:
    """An upper bound on the chunks of a call (the ``states`` buffer's rows): B·⌈T/C⌉ per row, or
    Σ⌈T_n/C⌉ <= ⌈T/C⌉ + N with boundaries. Static in the shapes, so fake tensors know it."""
    return (t + chunk - 1) // chunk + n if varlen else b * ((t + chunk - 1) // chunk)


def examples(b: int, t: int, cu_seqlens: Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of every example."""
    if cu_seqlens is None:
        return [(r, 0, t) for r in range(b)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


class Layout:
    """Where each chunk's C tokens come from, chunks step-major (see the module docstring).

    ``index`` (NCH, C) int64 into the B·T flattened tokens (B·T for padding); ``order`` the
    examples longest first; ``steps[j] = (first chunk, examples active)`` of step j."""

    def __init__(self, b: int, t: int, cu_seqlens: Tensor | None, chunk: int, device):
        spans = examples(b, t, cu_seqlens)
        counts = [(e - s + chunk - 1) // chunk for _, s, e in spans]
        self.n, self.chunk, self.tokens = len(spans), chunk, b * t
        self.order = sorted(range(self.n), key=lambda i: -counts[i])
        starts, ends, self.steps, first = [], [], [], 0
        for j in range(max(counts, default=0)):
            active = [i for i in self.order if counts[i] > j]
            self.steps.append((first, len(active)))
            first += len(active)
            for i in active:
                row, s, e = spans[i]
                starts.append(row * t + s + j * chunk)
                ends.append(row * t + e)
        self.count = first
        starts, ends = (torch.tensor(x, dtype=torch.int64).reshape(-1, 1) for x in (starts, ends))
        index = starts + torch.arange(chunk)  # (NCH, C)
        self.index = torch.where(index < ends, index, b * t).to(device)
        self.perm = torch.tensor(self.order, dtype=torch.int64, device=device)
        self.unperm = torch.argsort(self.perm)

    def gather(self, x: Tensor, dtype) -> Tensor:
        """(B, T, H, ...) -> (NCH, H, C, ...) in ``dtype``, padding zero."""
        flat = x.reshape(self.tokens, *x.shape[2:]).to(dtype)
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])  # row B·T: the padding
        out = flat[self.index]  # (NCH, C, H, ...)
        return out.movedim(1, 2)

    def scatter(self, x: Tensor, shape, dtype) -> Tensor:
        """(NCH, H, C, ...) -> (B, T, H, ...) (``shape``) in ``dtype``; padding dropped."""
        flat = x.new_zeros(self.tokens + 1, *x.shape[1:2], *x.shape[3:])
        flat.index_copy_(0, self.index.flatten(), x.movedim(2, 1).flatten(0, 1))
        return flat[: self.tokens].reshape(shape).to(dtype)


def normalised(x: Tensor, hv: int, l2norm: bool, dtype) -> tuple[Tensor, Tensor | None]:
    """(B, T, Hk, D) -> ((B, T, Hv, D) normalised in ``dtype``, rstd (B, T, Hk, 1) or None)."""
    x = x.to(dtype)
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) if l2norm else None
    if rstd is not None:
        x = x * rstd
    rep = hv // x.shape[2]
    return (x.repeat_interleave(rep, dim=2) if rep > 1 else x), rstd


def _intra(q, k, v, g, beta):
    """The chunk-local terms: (NCH, H, C, .) inputs -> dict of γ, e, f, D, P, M, U, W, Kb."""
    c = q.shape[-2]
    gam = g.cumsum(-1)  # (NCH, H, C)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    dec = (gam[..., :, None] - gam[..., None, :]).masked_fill(upper, float("-inf")).exp()
    e = gam.exp()
    kb = k * beta[..., None]
    m = (kb @ k.mT) * dec  # (NCH, H, C, C); the solve reads its strict lower triangle only
    rhs = torch.cat([v * beta[..., None], kb * e[..., None]], -1)
    uw = torch.linalg.solve_triangular(m, rhs, upper=False, unitriangular=True)
    u, w = uw.split([v.shape[-1], k.shape[-1]], -1)
    f = (gam[..., -1:] - gam).exp()
    return {"gam": gam, "e": e, "f": f, "dec": dec, "p": (q @ k.mT) * dec, "m": m, "u": u,
            "w": w, "kb": kb}  # fmt: skip


def _prepare(q, k, v, g, beta, cu_seqlens, l2norm, chunk):
    b, t, hv, dv = v.shape
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    lay = Layout(b, t, cu_seqlens, chunk, v.device)
    qn, _ = normalised(q, hv, l2norm, dt)
    kn, _ = normalised(k, hv, l2norm, dt)
    qn = qn * q.shape[-1] ** -0.5
    qc, kc, vc = (lay.gather(x, dt) for x in (qn, kn, v))  # (NCH, Hv, C, D)
    gc, bc = lay.gather(g, dt), lay.gather(beta, dt)  # (NCH, Hv, C)
    return lay, dt, qc, kc, vc, gc, bc


def forward(q, k, v, g, beta, initial_state, cu_seqlens, l2norm, save_states, chunk=CHUNK):
    """``(o (B, T, Hv, Dv) v.dtype, final (N, Hv, Dk, Dv), states (NCH_max or 0, Hv, Dk, Dv))``;
    fp32 math (fp64 for fp64 inputs), states and final in that dtype."""
    b, t, hv, dv = v.shape
    dk = k.shape[-1]
    lay, dt, qc, kc, vc, gc, bc = _prepare(q, k, v, g, beta, cu_seqlens, l2norm, chunk)
    x = _intra(qc, kc, vc, gc, bc)
    kd = kc * x["f"][..., None]
    e_last = x["e"][..., -1, None, None]  # (NCH, Hv, 1, 1)
    state = v.new_zeros(lay.n, hv, dk, dv, dtype=dt)
    if initial_state is not None:
        state.copy_(initial_state[lay.perm])
    bound = max_chunks(b, t, lay.n, cu_seqlens is not None, chunk)
    s0 = state.new_empty(max(bound, lay.count), hv, dk, dv)  # (NCH_max, Hv, Dk, Dv)
    s0[lay.count :].zero_()  # rows no chunk uses: defined values (a custom op's outputs compare)
    vn = torch.empty_like(x["u"])
    for first, active in lay.steps:
        sl = slice(first, first + active)
        s = state[:active]
        s0[sl] = s
        vn[sl] = torch.baddbmm(x["u"][sl].flatten(0, 1), x["w"][sl].flatten(0, 1),
                               s.flatten(0, 1), alpha=-1).view_as(vn[sl])  # fmt: skip
        state[:active] = s * e_last[sl] + kd[sl].mT @ vn[sl]
    s0c = s0[: lay.count]
    o = (qc * x["e"][..., None]) @ s0c + x["p"] @ vn  # (NCH, Hv, C, Dv)
    out = lay.scatter(o, (b, t, hv, dv), v.dtype)
    states = s0 if save_states else s0[:0]
    return out, state[lay.unperm], states


def backward(do, dfinal, q, k, v, g, beta, initial_state, states, cu_seqlens, l2norm, needs,
             chunk=CHUNK):  # fmt: skip
    """Gradients ``(dq, dk, dv, dg, dbeta, dinitial_state)`` in their inputs' dtypes, each None
    unless ``needs`` (6 bools) asks for it."""
    b, t, hv, dv = v.shape
    dk = k.shape[-1]
    lay, dt, qc, kc, vc, gc, bc = _prepare(q, k, v, g, beta, cu_seqlens, l2norm, chunk)
    x = _intra(qc, kc, vc, gc, bc)
    s0 = states[: lay.count]
    vn = x["u"] - x["w"] @ s0  # (NCH, Hv, C, Dv)
    doc = lay.gather(do, dt)
    e, f = x["e"], x["f"]
    qg = qc * e[..., None]
    dvn = x["p"].mT @ doc  # (NCH, Hv, C, Dv); the state terms are added step by step
    qdo = qg.mT @ doc  # (NCH, Hv, Dk, Dv)
    ds = vn.new_zeros(lay.n, hv, dk, dv)
    if dfinal is not None:
        ds.copy_(dfinal[lay.perm])
    ds_end = torch.empty_like(s0)  # the gradient of each chunk's end state
    kd = kc * f[..., None]
    e_last = e[..., -1, None, None]
    for first, active in reversed(lay.steps):
        sl = slice(first, first + active)
        d = ds[:active]
        ds_end[sl] = d
        dvn[sl] += kd[sl] @ d
        ds[:active] = qdo[sl] + d * e_last[sl] - x["w"][sl].mT @ dvn[sl]
    dh0 = ds[lay.unperm].to(initial_state.dtype) if needs[5] and initial_state is not None else None
    if not any(needs[:5]):
        return None, None, None, None, None, dh0
    dq, dkk, dgam = _through_reads(doc, vn, s0, ds_end, qc, kc, x)
    dvc, dbeta, dkk, dgam = _through_wy(dvn, s0, kc, vc, bc, x, dkk, dgam)
    dgc = dgam.flip(-1).cumsum(-1).flip(-1)  # γ_t = Σ_{i<=t} g_i
    grads = _to_inputs(lay, (dq, dkk, dvc, dgc, dbeta), q, k, v, g, beta, l2norm, needs, dt)
    return (*grads, dh0)


def _through_reads(doc, vn, s0, ds_end, qc, kc, x):
    """dQ, dK and dγ through O's two reads and S_end's write (before the WY terms)."""
    e, f, dec = x["e"], x["f"], x["dec"]
    dpd = doc @ vn.mT  # (NCH, Hv, C, C): dP
    dp = dpd * dec  # causal with the diagonal
    dq_state = e[..., None] * (doc @ s0.mT)
    dq = dq_state + dp @ kc
    dkf = f[..., None] * (vn @ ds_end.mT)
    dkk = dkf + dp.mT @ qc
    # dγ from each pair's decay D_ts = exp(γ_t - γ_s) elementwise (dP ⊙ P, strictly lower: the
    # diagonal's D = 1 has no γ), not as rowsum(dQ ⊙ Q) - rowsum(dK ⊙ K): those carry the diagonal
    # term twice, to cancel, and round at its size; under strong decays (every D_ts, s < t, tiny)
    # dg was 2-5x further from fp64 than transformers' autograd (tests/ops/test_gated_delta.py)
    pair = (dpd * x["p"]).tril(-1)
    dgam = (dq_state * qc).sum(-1) - (dkf * kc).sum(-1) + pair.sum(-1) - pair.sum(-2)
    last = e[..., -1] * (ds_end * s0).sum((-1, -2)) + (dkf * kc).sum((-1, -2))
    dgam[..., -1] += last
    return dq, dkk, dgam


def _through_wy(dvn, s0, kc, vc, bc, x, dkk, dgam):
    """dV, dβ and the K and γ terms through U, W = (I + M)⁻¹ [diag(β) V | diag(β e) K]."""
    u, w, m, dec, e, kb = x["u"], x["w"], x["m"], x["dec"], x["e"], x["kb"]
    rhs = torch.cat([dvn, -(dvn @ s0.mT)], -1)  # [dU | dW]
    dd = torch.linalg.solve_triangular(m.mT, rhs, upper=True, unitriangular=True)
    dvb, dkbg = dd.split([vc.shape[-1], kc.shape[-1]], -1)
    kbg = kb * e[..., None]
    dvc = dvb * bc[..., None]
    dbeta = (dvb * vc).sum(-1) + (dkbg * kc * e[..., None]).sum(-1)
    dkk = dkk + dkbg * (bc * e)[..., None]
    dgam = dgam + (dkbg * kbg).sum(-1)
    dm = -(dvb @ u.mT + dkbg @ w.mT).tril(-1)  # dM, strictly lower
    dmd = dm * dec
    dkb = dmd @ kc
    dk_t = dmd.mT @ kb
    dkk = dkk + dkb * bc[..., None] + dk_t
    dbeta = dbeta + (dkb * kc).sum(-1)
    pair = dm * m  # dM ⊙ M: the pairs' decay terms (see _through_reads)
    dgam = dgam + pair.sum(-1) - pair.sum(-2)
    return dvc, dbeta, dkk, dgam


def _to_inputs(lay, chunked, q, k, v, g, beta, l2norm, needs, dt):
    """Chunk-layout gradients -> the inputs' layouts and dtypes: GQA heads summed, the q scale
    and the L2 norm's backward applied."""
    dq, dkk, dvc, dgc, dbeta = chunked
    b, t, hv, dv = v.shape
    out = [None] * 5
    for i, (grad, src) in enumerate(((dq, q), (dkk, k))):
        if not needs[i]:
            continue
        full = lay.scatter(grad, (b, t, hv, src.shape[-1]), dt)
        full = full.view(b, t, src.shape[2], hv // src.shape[2], -1).sum(3)  # (B, T, Hk, Dk)
        if i == 0:
            full = full * src.shape[-1] ** -0.5
        if l2norm:
            xs = src.to(dt)
            rstd = torch.rsqrt((xs * xs).sum(-1, keepdim=True) + 1e-6)
            n = xs * rstd
            full = rstd * (full - n * (n * full).sum(-1, keepdim=True))
        out[i] = full.to(src.dtype)
    for i, grad, src in ((2, dvc, v), (3, dgc, g), (4, dbeta, beta)):
        if needs[i]:
            out[i] = lay.scatter(grad, src.shape, src.dtype)
    return out
