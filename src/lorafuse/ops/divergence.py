"""Per-token divergence between a student's and a teacher's next-token distributions, from their
final hidden states and frozen LM heads, chunk by chunk over tokens (knowledge distillation).

Shapes: student hidden (N, Hs), weight (V, Hs), bias (V,); teacher hidden (N, Ht), weight (V, Ht),
bias (V,) -> ``(divergence (N,) fp32, student entropy (N,) fp32)``. ``beta`` 0: forward KL, 1:
reverse KL, else TRL's generalized JSD, at temperature T. No (N, V) logits: each chunk's
gradient with respect to the student's hidden is formed in forward and saved, (N, Hs) fp32;
backward scales it. Both heads frozen. Formulas and precision: docs/kernels.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lorafuse.ops import autocast
from lorafuse.ops.cross_entropy import CHUNK_BYTES, chunk_rows

# fp32 (chunk, V) tiles alive at once in a chunk (both logits, both log-probs, p_s, the mixture):
# the automatic chunk keeps them within CHUNK_BYTES together
TILES = 6
BLOCK_BYTES = 16 * 2**20  # fp32 W rows converted at once for low-precision logits off CUDA


def divergence_reference(hs, ws, ht, wt, beta: float, temperature: float = 1.0, bs=None, bt=None):
    """The whole-logits form (autograd; the test oracle): ``(divergence (N,), entropy (N,))``."""
    zs = F.linear(hs, ws, bs).float() / temperature  # (N, V)
    zt = F.linear(ht, wt, bt).float() / temperature  # (N, V)
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    entropy = -(ls.exp() * ls).sum(-1).detach()
    if beta == 0.0:
        return F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1), entropy
    if beta == 1.0:
        return F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1), entropy
    lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), dim=0)
    kl_t = F.kl_div(lm, lt, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(lm, ls, reduction="none", log_target=True).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s, entropy


def chunk_divergence(zs: torch.Tensor, zt: torch.Tensor, beta: float):
    """``(divergence (n,), entropy (n,), d divergence / d zs (n, V))`` of fp32 tempered logits."""
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)  # (n, V) each
    ps = ls.exp()
    entropy = -(ps * ls).sum(-1)
    if beta == 0.0:
        pt = lt.exp()
        div = (pt * (lt - ls)).sum(-1)
        return div, entropy, ps - pt
    if beta == 1.0:
        gap = ls - lt  # (n, V)
        div = (ps * gap).sum(-1)
        return div, entropy, ps * (gap - div[:, None])
    lm = torch.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))  # log of the mixture
    gap = ls - lm
    kl_s = (ps * gap).sum(-1)  # KL(p_s || m)
    div = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * kl_s
    return div, entropy, (1 - beta) * ps * (gap - kl_s[:, None])


def head_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(n, V) fp32 logits ``h·Wᵀ + b``, never rounded to a low-precision dtype (as TRL's chunks):
    bf16 / fp16 operands are multiplied with fp32 output on CUDA, and in fp32 over blocks of
    ``BLOCK_BYTES`` of W elsewhere (their products are exact in fp32). Rounding the logits to bf16
    instead made the divergence and its gradient 2-4x further from an fp64 oracle than TRL's."""
    if h.dtype == torch.float32:
        z = h @ w.t()
    elif h.is_cuda:  # mm with an fp32 output (CUDA only)
        z = torch.mm(h, w.t(), out_dtype=torch.float32)
    else:
        z = torch.empty((h.shape[0], w.shape[0]), dtype=torch.float32, device=h.device)
        hf = h.float()
        step = max(1, BLOCK_BYTES // (4 * w.shape[1]))
        for v in range(0, w.shape[0], step):
            torch.mm(hf, w[v : v + step].float().t(), out=z[:, v : v + step])
    return z if b is None else z.add_(b.float())


def head_grad(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(n, H) fp32 ``g·W`` of fp32 logit gradients g (n, V), summed in fp32 like
    :func:`head_logits` (CUDA: g rounded to W's dtype, fp32 output, as TRL)."""
    if w.dtype == torch.float32:
        return g @ w
    if g.is_cuda:
        return torch.mm(g.to(w.dtype), w, out_dtype=torch.float32)
    out = torch.zeros((g.shape[0], w.shape[1]), dtype=torch.float32, device=g.device)
    step = max(1, BLOCK_BYTES // (4 * w.shape[1]))
    for v in range(0, w.shape[0], step):
        out.addmm_(g[:, v : v + step], w[v : v + step].float())
    return out


class DivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, beta, temperature, chunk, need_h):
        N = hs.shape[0]
        # (N, Hs) d D_i / d hs_i in fp32: backward scales it and rounds once (a bf16 copy here
        # would round twice, doubling the mean gradient error against an fp32 oracle)
        grad_h = torch.empty(hs.shape, dtype=torch.float32, device=hs.device) if need_h else None
        div = torch.empty(N, dtype=torch.float32, device=hs.device)
        entropy = torch.empty(N, dtype=torch.float32, device=hs.device)
        for s in range(0, N, chunk):
            zs = head_logits(hs[s : s + chunk], ws, bs)  # (n, V) fp32
            zt = head_logits(ht[s : s + chunk], wt, bt)  # (n, V) fp32
            d, e, g = chunk_divergence(zs.div_(temperature), zt.div_(temperature), beta)
            div[s : s + chunk], entropy[s : s + chunk] = d, e
            if need_h:  # d z_s / d h = W_s, and the temperature's 1/T
                grad_h[s : s + chunk] = head_grad(g.div_(temperature), ws)
            del zs, zt, g
        ctx.save_for_backward(grad_h)
        ctx.dtype = hs.dtype
        ctx.mark_non_differentiable(entropy)
        return div, entropy

    @staticmethod
    def backward(ctx, g, _):
        (grad_h,) = ctx.saved_tensors
        dh = None
        if grad_h is not None and g is not None:
            dh = (grad_h * g.float()[:, None]).to(ctx.dtype)  # (N, Hs)
        return dh, None, None, None, None, None, None, None, None, None


def _check(hs, ws, bs, ht, wt, bt, beta, temperature):
    name = "divergence"
    for label, h, w, b in (("student", hs, ws, bs), ("teacher", ht, wt, bt)):
        if h.dim() != 2 or w.dim() != 2 or w.shape[1] != h.shape[1]:
            raise ValueError(f"{name}: {label} hidden (N, H) and weight (V, H) expected, got "
                             f"{tuple(h.shape)} and {tuple(w.shape)}")  # fmt: skip
        if w.dtype != h.dtype:
            raise ValueError(f"{name}: {label} weight dtype {w.dtype} != hidden dtype {h.dtype}")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"{name}: {label} bias must be ({w.shape[0]},), got {tuple(b.shape)}")
        if torch.is_grad_enabled() and (w.requires_grad or (b is not None and b.requires_grad)):
            raise ValueError(f"{name}: the {label} LM head requires grad; this op supports "
                             "frozen heads only (LoRA keeps them frozen)")  # fmt: skip
    if ws.shape[0] != wt.shape[0]:
        raise ValueError(f"{name}: student vocabulary {ws.shape[0]} != teacher's {wt.shape[0]}")
    if hs.shape[0] != ht.shape[0]:
        raise ValueError(f"{name}: {hs.shape[0]} student rows vs {ht.shape[0]} teacher rows")
    if ht.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name}: the teacher's hidden states require grad (compute them under "
                         "torch.no_grad)")  # fmt: skip
    if not 0.0 <= beta <= 1.0 or not temperature > 0:
        raise ValueError(f"{name}: beta must be in [0, 1] and temperature > 0, got beta={beta}, "
                         f"temperature={temperature}")  # fmt: skip


def divergence(hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor,
               beta: float, temperature: float = 1.0, bs: torch.Tensor | None = None,
               bt: torch.Tensor | None = None, chunk_size: int | None = None):  # fmt: skip
    """``(divergence (N,) fp32, student entropy (N,) fp32)``; docs/kernels.md has the formulas."""
    dt = autocast.autocast_dtype(hs)
    if dt is not None:  # as stock: the heads under autocast, the softmax on upcast logits
        with autocast.disabled(hs.device):
            hs, ws, bs, ht, wt, bt = (autocast.cast(t, dt) for t in (hs, ws, bs, ht, wt, bt))
            return divergence(hs, ws, ht, wt, beta, temperature, bs, bt, chunk_size)
    _check(hs, ws, bs, ht, wt, bt, float(beta), float(temperature))
    chunk = chunk_rows(max(1, hs.shape[0]), ws.shape[0], chunk_size, CHUNK_BYTES // TILES)
    need_h = torch.is_grad_enabled() and hs.requires_grad
    return DivergenceFunction.apply(
        hs.contiguous(), ws.contiguous(), bs, ht.contiguous(), wt.contiguous(), bt,
        float(beta), float(temperature), chunk, need_h,
    )  # fmt: skip
