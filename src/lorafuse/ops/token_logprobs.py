"""Per-sequence sums of target-token log-probabilities from hidden states and a frozen LM head.

``out[s] = Σ_{i: seq_ids[i] = s, targets[i] != ignore_index} log softmax(hidden_i·Wᵀ (+ b))[targets[i]]``

Shapes: hidden (N, H), weight (V, H), bias (V,), targets (N,) int64, seq_ids (N,) int64 in
``[0, S)`` -> out (S,) fp32. Or hidden (S, T, H) with targets (S, T) and no ``seq_ids``: each
row of T tokens is one sequence. Targets are aligned with ``hidden`` (row i predicts
``targets[i]``); the causal shift is the caller's job. This is what preference training (DPO,
ORPO) needs: ``log π(y | x)`` of the chosen and rejected responses.

* Never forms the (N, V) logits: chunked over tokens exactly as
  :mod:`lorafuse.ops.cross_entropy`, and it runs that op's chunk kernel (every backend: torch,
  C++, Triton) with ``grad_scale = -1``: the kernel returns the row's cross-entropy
  ``lse - logit_target = -log p`` and turns the chunk's logits into ``onehot - softmax``,
  which is ``d log p_i / d logits_i``. One more GEMM gives ``d log p_i / d hidden_i`` (n, H).
* Why that is exact for any incoming gradient: ``log p_i`` depends on ``hidden_i`` only, so
  ``d L / d hidden_i = g[seq_ids[i]] · d log p_i / d hidden_i``. Forward computes those per-row
  gradients chunk by chunk and saves them (N_valid, H), in ``hidden``'s dtype, as the fused
  cross-entropy saves its finished gradient); backward scales each row by its sequence's
  incoming gradient (in fp32, then cast). Nothing is recomputed.
* The LM head must be frozen (as it is under LoRA): a weight or bias that requires grad
  raises ``ValueError``, since its gradient would need the (V, H) product per sequence weight.
* Rows whose target is ``ignore_index`` (prompt, padding) are dropped before the GEMMs.
* Under ``torch.autocast`` the operands are cast to the autocast dtype and the op runs with
  autocast off, as the fused cross-entropy does (logits upcast to fp32 per chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafuse import backends
from lorafuse.ops import autocast
from lorafuse.ops.cross_entropy import chunk_rows
from lorafuse.ops.cross_entropy_chunks import implementation


def token_logprobs_reference(
    hidden, weight, targets, seq_ids, n_seqs, bias=None, ignore_index=-100
):
    """Plain autograd math (the oracle): full fp32 logits, ``log_softmax``, gather, scatter-add."""
    logits = F.linear(hidden, weight, bias).float()  # (N, V)
    valid = targets != ignore_index  # (N,)
    safe = torch.where(valid, targets, 0)[:, None]  # (N, 1)
    lp = logits.log_softmax(-1).gather(1, safe).squeeze(1)  # (N,)
    lp = torch.where(valid, lp, 0.0)
    out = torch.zeros(n_seqs, dtype=torch.float32, device=hidden.device)
    return out.index_add(0, seq_ids, lp)  # (S,)


class TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, seq_ids, n_seqs, chunk, backend, need_h):
        kernel = implementation(backend)
        N, H = hidden.shape
        mm = backends.matmul_dtype(hidden.device, hidden.dtype)
        w_mm = weight.to(mm)  # (V, H); a transient copy only where low precision is slow (CPU)
        grad_h = torch.empty_like(hidden) if need_h else None  # (N, H): d log p_i / d hidden_i
        out = torch.zeros(n_seqs, dtype=torch.float32, device=hidden.device)  # (S,)
        for s in range(0, N, chunk):
            h = hidden[s : s + chunk].to(mm)  # (n, H)
            logits = (h @ w_mm.t()).float()  # (n, V) fp32
            if bias is not None:
                logits += bias.float()
            # grad_scale -1: returns -log p (n,), logits become onehot - softmax = d log p / d logits.
            # Every kept target is valid (the entry point dropped the ignored rows), so the
            # kernel's ignore_index never matches; -1 is outside [0, V).
            nll = kernel(logits, targets[s : s + chunk], -1, -1.0)
            out.index_add_(0, seq_ids[s : s + chunk], -nll)
            if need_h:
                grad_h[s : s + chunk] = logits.to(mm) @ w_mm  # (n, H)
            del logits
        ctx.save_for_backward(grad_h, seq_ids)
        return out

    @staticmethod
    def backward(ctx, g):
        grad_h, seq_ids = ctx.saved_tensors
        dh = None
        if grad_h is not None:
            # per-row scale: each row's log p feeds exactly one sequence's output
            dh = (grad_h.float() * g.float()[seq_ids][:, None]).to(grad_h.dtype)  # (N, H)
        return dh, None, None, None, None, None, None, None, None


def _check(hidden, weight, targets, seq_ids, bias):
    name = "token_logprobs"
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
        raise ValueError(f"{name}: hidden must be a float tensor, got {type(hidden).__name__}")
    H = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"{name}: weight must be (V, {H}) for hidden {tuple(hidden.shape)}, "
                         f"got {tuple(weight.shape)}")  # fmt: skip
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{name}: weight dtype {weight.dtype} != hidden dtype {hidden.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{name}: targets must be {tuple(hidden.shape[:-1])} for hidden "
                         f"{tuple(hidden.shape)}, got {tuple(targets.shape)}")  # fmt: skip
    if seq_ids is None and hidden.dim() != 3:
        raise ValueError(f"{name}: without seq_ids hidden must be (S, T, H), got "
                         f"{tuple(hidden.shape)}")  # fmt: skip
    if seq_ids is not None and (hidden.dim() != 2 or tuple(seq_ids.shape) != (hidden.shape[0],)):
        raise ValueError(f"{name}: with seq_ids hidden must be (N, H) and seq_ids (N,), got "
                         f"{tuple(hidden.shape)} and {tuple(seq_ids.shape)}")  # fmt: skip
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if torch.is_grad_enabled() and (
        weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        raise ValueError(
            f"{name}: the LM head weight/bias requires grad; this op supports a frozen head only "
            "(LoRA training keeps it frozen); compute log_softmax on the logits for a trained head"
        )


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    seq_ids: torch.Tensor | None = None,
    n_seqs: int | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Sum of ``log p(targets)`` per sequence; returns (S,) fp32 (see the module docstring)."""
    dt = autocast.autocast_dtype(hidden)
    if dt is not None:  # as stock: lm_head under autocast, log_softmax on the upcast logits
        with autocast.disabled(hidden.device):
            hidden, weight, bias = (autocast.cast(t, dt) for t in (hidden, weight, bias))
            return token_logprobs(hidden, weight, targets, seq_ids, n_seqs, bias, ignore_index,
                                  chunk_size, backend)  # fmt: skip
    _check(hidden, weight, targets, seq_ids, bias)
    H, V = hidden.shape[-1], weight.shape[0]
    if seq_ids is None:
        S, T = targets.shape
        seq_ids = torch.arange(S, device=hidden.device).repeat_interleave(T)  # (S*T,)
        n_seqs = S
    elif n_seqs is None:
        n_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    h2 = hidden.reshape(-1, H)  # (N, H)
    t2 = targets.reshape(-1).to(torch.int64)  # (N,)
    s2 = seq_ids.reshape(-1).to(device=hidden.device, dtype=torch.int64)  # (N,)
    valid = t2 != ignore_index
    bad = valid & ((t2 < 0) | (t2 >= V))
    if bool(bad.any()):
        raise ValueError(f"token_logprobs: target {int(t2[bad][0])} is outside [0, {V}) and not "
                         f"ignore_index ({ignore_index})")  # fmt: skip
    keep = valid.nonzero().squeeze(1)  # ignored rows cost no vocabulary projection
    h2, t2, s2 = h2.index_select(0, keep).contiguous(), t2[keep], s2[keep]
    chunk = chunk_rows(max(1, h2.shape[0]), V, chunk_size)
    chosen = backends.select("cross_entropy", hidden.device, backend)
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    return TokenLogprobsFunction.apply(
        h2, weight.contiguous(), bias, t2.contiguous(), s2.contiguous(), int(n_seqs), chunk,
        chosen, need_h,
    )  # fmt: skip
