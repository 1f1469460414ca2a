"""Fused linear + cross-entropy: the LM loss without ever forming the (N, V) logits.

``loss = Σ_i CE(hidden_i·Wᵀ (+ b), target_i) / denominator`` over N token rows, vocabulary V.

Shapes: hidden (N, H), weight (V, H), bias (V,), targets (N,) int64 -> scalar fp32 loss.

* Targets are already aligned with ``hidden`` (row i predicts ``targets[i]``): shifting labels
  for causal LM is the caller's job (see ``transformers.loss.loss_utils.ForCausalLMLoss``).
* Chunked over tokens (Liger-style): per chunk of ``n`` rows the logits are computed in fp32
  (the product in :func:`lorafuse.backends.matmul_dtype`, so on CUDA a bf16 model's logits are
  the bf16 product upcast, exactly as HF's ``logits.float()``), the chunk kernel
  turns them *in place* into ``d loss / d logits``, and the gradients of ``hidden`` (N, H) and —
  only when they require grad — ``weight`` (V, H, fp32 accumulator) and ``bias`` are
  accumulated right there, during forward. Peak extra memory is one (n, V) fp32 chunk
  (auto: ~128 MiB) instead of the (N, V) logits plus their fp32 copy and softmax.
* Saved for backward: only those finished gradients; backward multiplies them by the incoming
  (scalar) gradient. Nothing is recomputed.
* Rows whose target is ``ignore_index`` (prompt tokens, padding, each sequence's last position)
  are dropped before the GEMMs, so masked tokens cost no vocabulary projection at all.
* Normalisation (HF's conventions): ``num_items_in_batch`` given -> sum / num_items_in_batch
  (gradient accumulation, as ``fixed_cross_entropy``; ``reduction`` is then ignored, as HF
  ignores it); else ``"mean"`` -> sum / (number of targets != ignore_index), ``"sum"`` -> sum.
  A batch whose targets are all ``ignore_index`` gives loss 0 and zero gradients under every
  reduction (HF's ``"mean"`` would give nan, which poisons a training run; its ``"sum"`` and
  ``num_items_in_batch`` paths give 0 too).
* Under ``torch.autocast`` it does what stock does there (``lm_head`` under autocast, then the
  loss on ``logits.float()``): ``hidden``, ``weight`` and ``bias`` are cast to the autocast dtype
  and the op runs with autocast off (:mod:`lorafuse.ops.autocast`), so each chunk's logits are
  the autocast-dtype product (where it is native; fp32 products of the same operands elsewhere)
  upcast to fp32 before the log-sum-exp.
* A LoRA adapter on ``lm_head`` is not supported here: passing ``lora_A``/``lora_B`` raises
  NotImplementedError rather than training the head's adapter silently wrong.

Backends: ``torch`` (:func:`_torch_chunk_forward_backward`), ``cpp``
(``csrc/cross_entropy.cpp``: ``cross_entropy_chunk_forward_backward``), ``triton``
(``triton/cross_entropy.py``: ``chunk_forward_backward``). Only the chunk kernel differs; the
chunk loop and the GEMMs are this file's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafuse import backends
from lorafuse.ops import autocast, custom_ops

# Bytes of fp32 logits per chunk when chunk_size is automatic. Each chunk streams the whole
# (V, H) weight twice, so small chunks are memory-bound: V=32000 H=1024 over 2048 tokens, fp32,
# 2 threads, forward + input-gradient GEMMs took 1.85 s with 256-row chunks (32 MiB), 1.64 s with
# 1024 rows (128 MiB), 1.60 s unchunked (benchmarks/bench_ce_chunk.py, medians of 6). 128 MiB is
# still half of stock's fp32 logits at 4 x 512.
CHUNK_BYTES = 128 * 2**20


def linear_cross_entropy_reference(hidden, weight, targets, bias=None, ignore_index=-100,
                                   reduction="mean", num_items_in_batch=None):  # fmt: skip
    """Plain autograd math, as HF computes it (``logits.float()``, ``fixed_cross_entropy``)."""
    logits = F.linear(hidden, weight, bias).float()
    if num_items_in_batch is not None:
        loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
        return loss / num_items_in_batch
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


def _torch_chunk_forward_backward(logits, targets, ignore_index, grad_scale):
    """The chunk kernel (every backend implements it). ``logits`` (n, V) fp32 becomes ``grad_scale·(softmax - onehot)`` in place
    (zero rows where ``targets == ignore_index``); returns the per-row loss (n,) fp32."""
    n, V = logits.shape
    valid = targets != ignore_index  # (n,)
    bad = valid & ((targets < 0) | (targets >= V))
    if bool(bad.any()):
        raise ValueError(
            f"cross_entropy: target {int(targets[bad][0])} is outside [0, {V}) and not "
            f"ignore_index ({ignore_index})"
        )
    safe = torch.where(valid, targets, 0)[:, None]  # (n, 1)
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    loss = torch.where(valid, lse - logits.gather(1, safe).squeeze(1), 0.0)
    logits.sub_(lse[:, None]).exp_()  # softmax, in place
    logits.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=logits.dtype))
    logits.mul_(grad_scale).masked_fill_(~valid[:, None], 0.0)
    return loss


def _implementation(backend: str):
    if backend == "torch":
        return _torch_chunk_forward_backward
    return backends.compiled("cross_entropy", backend, "chunk_forward_backward")[0]


def _chunk_rows(n_rows: int, vocab: int, chunk_size: int | None) -> int:
    if chunk_size is None:
        chunk_size = max(1, CHUNK_BYTES // (4 * vocab))
    return max(1, min(int(chunk_size), n_rows))


def _chunked(hidden, weight, bias, targets, ignore_index, grad_scale, chunk, backend, needs):
    """The chunk loop: ``(loss () fp32, grad_h (N, H) | None, grad_w (V, H) fp32 | None,
    grad_b (V,) fp32 | None)``, gradients only where ``needs`` (hidden, weight, bias) says."""
    kernel = _implementation(backend)
    need_h, need_w, need_b = needs
    N, H = hidden.shape
    V = weight.shape[0]
    mm = backends.matmul_dtype(hidden.device, hidden.dtype)
    w_mm = weight.to(mm)  # (V, H); a transient copy only where low precision is slow (CPU)
    grad_h = torch.empty_like(hidden) if need_h else None  # (N, H)
    grad_w = torch.zeros(V, H, dtype=torch.float32, device=hidden.device) if need_w else None
    grad_b = torch.zeros(V, dtype=torch.float32, device=hidden.device) if need_b else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for s in range(0, N, chunk):
        h = hidden[s : s + chunk].to(mm)  # (n, H)
        logits = (h @ w_mm.t()).float()  # (n, V) fp32; bf16 product upcast on CUDA, as HF
        if bias is not None:
            logits += bias.float()
        total += kernel(logits, targets[s : s + chunk], ignore_index, grad_scale).sum()
        # `logits` now holds d loss / d logits (already scaled by grad_scale).
        if need_h:
            grad_h[s : s + chunk] = logits.to(mm) @ w_mm  # (n, H)
        if need_w:
            if mm == torch.float32:
                grad_w.addmm_(logits.t(), h)  # (V, H) fp32 accumulation
            else:
                grad_w += logits.to(mm).t() @ h
        if need_b:
            grad_b += logits.sum(0)
        del logits
    return total * grad_scale, grad_h, grad_w, grad_b


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, ignore_index, grad_scale, chunk, backend, grad_on
    ):
        # needs_input_grad ignores no_grad mode (forward runs with grad off), hence `grad_on`:
        # evaluation under no_grad computes the loss only.
        needs = tuple(grad_on and n for n in ctx.needs_input_grad[:3])
        loss, *grads = _chunked(
            hidden, weight, bias, targets, ignore_index, grad_scale, chunk, backend, needs
        )
        ctx.save_for_backward(*grads)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        dh = dw = db = None
        if grad_h is not None:
            dh = grad_h * g.to(grad_h.dtype)
        if grad_w is not None:
            dw = (grad_w * g).to(ctx.dtypes[0])
        if grad_b is not None:
            db = (grad_b * g).to(ctx.dtypes[1])
        return dh, dw, db, None, None, None, None, None, None


def _check(hidden, weight, targets, bias, reduction):
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"fused_linear_cross_entropy: hidden must be a float tensor (N, H), got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)}")  # fmt: skip
    H = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"fused_linear_cross_entropy: weight must be (V, {H}) for hidden "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")  # fmt: skip
    if weight.dtype != hidden.dtype:
        raise ValueError(f"fused_linear_cross_entropy: weight dtype {weight.dtype} does not match "
                         f"hidden dtype {hidden.dtype}")  # fmt: skip
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"fused_linear_cross_entropy: targets must be {tuple(hidden.shape[:-1])} "
                         f"for hidden {tuple(hidden.shape)}, got {tuple(targets.shape)}")  # fmt: skip
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fused_linear_cross_entropy: targets must be int64, got {targets.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fused_linear_cross_entropy: bias must be ({weight.shape[0]},), got "
                         f"{tuple(bias.shape)}")  # fmt: skip
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_linear_cross_entropy: reduction must be 'mean' or 'sum', got "
                         f"{reduction!r}")  # fmt: skip
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError(f"fused_linear_cross_entropy: hidden on {hidden.device}, weight on "
                         f"{weight.device}, targets on {targets.device}")  # fmt: skip


def _grad_scale(targets, valid, vocab, ignore_index, reduction, num_items_in_batch) -> float:
    """1 / denominator, after checking every target is in range (one device sync).

    ``valid`` is ``targets != ignore_index``."""
    bad = valid & ((targets < 0) | (targets >= vocab))
    n_valid, n_bad = (int(v) for v in torch.stack([valid.sum(), bad.sum()]).tolist())
    if n_bad:
        raise ValueError(
            f"fused_linear_cross_entropy: {n_bad} target(s) outside [0, {vocab}) that are not "
            f"ignore_index ({ignore_index}), e.g. {int(targets[bad][0])}"
        )
    if num_items_in_batch is not None:
        denom = float(num_items_in_batch)
    else:
        denom = float(n_valid) if reduction == "mean" else 1.0
    if n_valid == 0:
        return 0.0  # nothing to learn from: loss 0 and zero gradients (see module docstring)
    if not denom > 0:
        raise ValueError(f"fused_linear_cross_entropy: num_items_in_batch={num_items_in_batch} "
                         f"but this batch has {n_valid} targets")  # fmt: skip
    return 1.0 / denom


def _drop_ignored_rows(hidden, targets, valid):
    """The rows whose target is not ``ignore_index`` (``valid``): the only ones the two (rows, V)
    GEMMs need.

    Ignored rows contribute neither loss nor gradient; under completion-only training they are
    the prompt tokens, often half a batch. ``index_select``'s backward scatters the gradient
    back, zeros in the dropped rows, which is exactly their gradient.
    """
    keep = valid.nonzero().squeeze(1)
    if keep.numel() == targets.numel():
        return hidden, targets
    return hidden.index_select(0, keep), targets.index_select(0, keep)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
    lora_A: torch.Tensor | None = None,
    lora_B: torch.Tensor | None = None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden·Wᵀ (+ b)`` against aligned ``targets``; returns a scalar fp32.

    ``hidden`` (..., H) with ``targets`` of the leading shape (...); both are flattened.
    """
    if lora_A is not None or lora_B is not None:
        raise NotImplementedError(
            "fused_linear_cross_entropy: LoRA on lm_head is not supported by the fused loss; "
            "use the stock loss for that model (its adapter would otherwise not be trained)"
        )
    dt = autocast.autocast_dtype(hidden)
    if dt is not None:  # stock: lm_head under autocast, then CE on the upcast logits
        with autocast.disabled(hidden.device):
            hidden, weight, bias = (autocast.cast(t, dt) for t in (hidden, weight, bias))
            return fused_linear_cross_entropy(
                hidden, weight, targets, bias, ignore_index, reduction, num_items_in_batch,
                chunk_size, backend,
            )  # fmt: skip
    _check(hidden, weight, targets, bias, reduction)
    H = hidden.shape[-1]
    h2 = hidden.reshape(-1, H).contiguous()  # (N, H)
    t2 = targets.reshape(-1).to(torch.int64).contiguous()  # (N,)
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        return _compiled_loss(h2, weight, bias, t2, ignore_index, reduction, num_items_in_batch,
                              chunk_size, backend)  # fmt: skip
    V = weight.shape[0]
    valid = t2 != ignore_index
    scale = _grad_scale(t2, valid, V, ignore_index, reduction, num_items_in_batch)
    h2, t2 = _drop_ignored_rows(h2, t2, valid)
    chunk = _chunk_rows(h2.shape[0], V, chunk_size)
    chosen = backends.select("cross_entropy", hidden.device, backend)
    return FusedLinearCrossEntropyFunction.apply(
        h2, weight.contiguous(), bias, t2, int(ignore_index), scale, chunk, chosen,
        torch.is_grad_enabled(),
    )  # fmt: skip


def loss_and_grads(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                   chunk_size, backend, needs):  # fmt: skip
    """The loss and the gradients the eager path computes, in one call (the custom op's body).

    hidden (N, H), targets (N,) int64, ``needs`` (hidden, weight, bias). Returns ``(loss,
    (grad_h (N, H) | None, grad_w (V, H) fp32 | None, grad_b (V,) fp32 | None))``: ignored rows
    are dropped before the GEMMs, as in eager, and get zero ``grad_h`` rows.
    """
    V = weight.shape[0]
    valid = targets != ignore_index
    scale = _grad_scale(targets, valid, V, ignore_index, reduction, num_items_in_batch)
    h2, t2 = _drop_ignored_rows(hidden, targets, valid)
    chunk = _chunk_rows(h2.shape[0], V, chunk_size)
    loss, grad_h, grad_w, grad_b = _chunked(
        h2, weight.contiguous(), bias, t2, int(ignore_index), scale, chunk, backend, needs
    )
    if grad_h is not None and h2.shape[0] != hidden.shape[0]:
        full = torch.zeros_like(hidden)  # (N, H): dropped rows have zero gradient
        grad_h = full.index_copy_(0, valid.nonzero().squeeze(1), grad_h)
    return loss, (grad_h, grad_w, grad_b)


def _compiled_loss(h2, weight, bias, t2, ignore_index, reduction, num_items_in_batch, chunk_size,
                   backend):  # fmt: skip
    """The loss through the ``lorafuse::linear_cross_entropy`` custom op (under torch.compile)."""
    chosen = backends.select("cross_entropy", h2.device, backend)
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and t is not None and t.requires_grad for t in (h2, weight, bias)]
    n_items = num_items_in_batch
    if n_items is not None and not isinstance(n_items, torch.Tensor):
        n_items = torch.tensor(float(n_items))
    loss, *_grads = custom_ops.linear_cross_entropy(
        h2, weight.contiguous(), bias, t2, int(ignore_index), reduction, n_items, chunk_size,
        chosen, needs,
    )  # fmt: skip
    return loss
