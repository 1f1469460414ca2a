"""Fused linear + cross-entropy: the LM loss without ever forming the (N, V) logits.

``loss = Σ_i CE(hidden_i·Wᵀ (+ b), target_i) / denominator``; row i predicts ``targets[i]``
(shifting labels is the caller's job). Shapes: hidden (N, H), weight (V, H), bias (V,), targets
(N,) int64 -> scalar fp32 loss. Chunked over tokens: each chunk's logits go into one reused
(chunk, V) scratch and its gradients are accumulated during forward. Saved for backward: only
those finished gradients (hidden; weight and bias where they require grad); nothing is
recomputed. How the chunks, precision, reductions, softcap and autocast work: docs/kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lorafuse import backends
from lorafuse.ops import autocast, custom_ops
from lorafuse.ops.cross_entropy_chunks import chunked
from lorafuse.ops.weights import is_quantized

# ---- Policy: rows per chunk and the scratch's dtype ---------------------------------------

# Bytes of fp32 logits per chunk when chunk_size is automatic. Each chunk streams the whole
# (V, H) weight twice, so small chunks are memory-bound: V=32000 H=1024 over 2048 tokens, fp32,
# 2 threads, forward + input-gradient GEMMs took 1.85 s with 256-row chunks (32 MiB), 1.64 s with
# 1024 rows (128 MiB), 1.60 s unchunked (benchmarks/probes/ce_chunk_bytes.py, medians of 6).
# 128 MiB is still half of stock's fp32 logits at 4 x 512. With native bf16 GEMMs the scratch holds bf16
# logits in the same rows, half the bytes: twice the rows measured no faster (SmolLM2's lm_head,
# N=2044 H=576 V=49152 bf16, op forward + backward with 512 / 682 / 1022-row chunks: 1.45 / 1.49 /
# 1.46 s; llama-4l's V=32000 H=1024: 0.74 / 0.83 / 0.71 s; medians of 9, load 5-7), so bf16 keeps
# the memory.
CHUNK_BYTES = 128 * 2**20
# A quantized head (QLoRA with quantize_embeddings=True: memory before speed) takes chunks of half
# the rows. There the scratch is the largest buffer of the step, alive beside every checkpointed
# layer input (Llama-3.2-1B NF4 at 1 x 512: 64 of 113 MiB), and each chunk dequantizes the head
# block by block twice (logits, then the input gradient); halved, the step's peak fell 32 MiB
# (1430 -> 1398 MiB) for ~0.3 s more per ~11 s step (lorafuse bench --quant nf4, docs/benchmarks.md).
QUANTIZED_HEAD_CHUNK_BYTES = CHUNK_BYTES // 2


# Below this many rows per chunk a low-precision scratch counts its own bytes (twice the rows of
# the fp32 rule, still within the budget): each chunk streams the whole (V, H) weight twice, and a
# large vocabulary leaves few rows. Qwen3.5's head, V 248320, H 1024, bf16, 1 thread, AMX Xeon:
# the logits + input-gradient GEMMs of 255 rows in 2 chunks 0.61 CPU s, in one 0.50 (`python
# benchmarks/probes/ce_chunk_bytes.py --tokens 255 --vocab 248320 --dtype bf16 --rows 128 255
# --threads 1`, load 11-12, wall medians of 5: 6.11 / 4.93 s). With 512+ rows the weight's reads
# are amortised (twice the rows measured no faster, CHUNK_BYTES above).
WIDE_ROWS = 512


def chunk_rows(n_rows: int, vocab: int, chunk_size: int | None, budget: int | None = None,
               scratch_bytes: int = 4) -> int:  # fmt: skip
    """Rows per chunk: ``chunk_size``, or automatically the fewest chunks whose (rows, vocab)
    fp32 logits fit ``budget`` (default :data:`CHUNK_BYTES`), balanced so that no ragged last
    chunk streams the whole (V, H) weight for a handful of rows (N=2050 in 682-row chunks would
    end with a 4-row chunk; balanced it is 4 chunks of 513). A scratch of ``scratch_bytes`` < 4
    per logit counts its own size where the fp32 rule gives under :data:`WIDE_ROWS` rows."""
    if chunk_size is not None:
        return max(1, min(int(chunk_size), n_rows))
    most = max(1, (budget or CHUNK_BYTES) // (4 * vocab))
    if most < WIDE_ROWS and scratch_bytes < 4:
        most = max(1, (budget or CHUNK_BYTES) // (scratch_bytes * vocab))
    n_chunks = -(-max(1, n_rows) // most)
    return max(1, -(-n_rows // n_chunks))


def chunk_dtypes(hidden: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """``(GEMM dtype, scratch dtype)`` of the chunks of ``hidden``: the GEMMs run in
    :func:`lorafuse.backends.matmul_dtype`; the scratch holds their logits in the GEMM's own
    dtype where it is low precision (the kernel upcasts per row), fp32 otherwise (fp32 GEMMs;
    fp64 products are upcast to fp32 as HF's ``.float()``)."""
    mm = backends.matmul_dtype(hidden.device, hidden.dtype)
    return mm, mm if mm in (torch.bfloat16, torch.float16) else torch.float32


# ---- The op: reference, autograd.Function, entry point ------------------------------------


def linear_cross_entropy_reference(hidden, weight, targets, bias=None, ignore_index=-100,
                                   reduction="mean", num_items_in_batch=None, softcap=None):  # fmt: skip
    """Plain autograd math, as HF computes it (Gemma 2's soft-capping in the model dtype,
    ``logits.float()``, ``fixed_cross_entropy``)."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    if num_items_in_batch is not None:
        loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
        return loss / num_items_in_batch
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, ignore_index, grad_scale, chunk, backend, grad_on,
        softcap=None,
    ):  # fmt: skip
        # needs_input_grad ignores no_grad mode (forward runs with grad off), hence `grad_on`:
        # evaluation under no_grad computes the loss only.
        needs = tuple(grad_on and n for n in ctx.needs_input_grad[:3])
        dtypes = chunk_dtypes(hidden)
        loss, *grads = chunked(
            hidden, weight, bias, targets, ignore_index, grad_scale, chunk, dtypes, backend, needs,
            softcap,
        )  # fmt: skip
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
        return dh, dw, db, None, None, None, None, None, None, None


def _check(hidden, weight, targets, bias, reduction):
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"fused_linear_cross_entropy: hidden must be a float tensor (N, H), got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)}")  # fmt: skip
    H = hidden.shape[-1]
    if len(weight.shape) != 2 or weight.shape[1] != H:
        raise ValueError(f"fused_linear_cross_entropy: weight must be (V, {H}) for hidden "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")  # fmt: skip
    if not is_quantized(weight) and weight.dtype != hidden.dtype:  # quantized: dequantized to it
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
        return 0.0  # nothing to learn from: loss 0, zero gradients (HF's "mean" gives nan)
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
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden·Wᵀ (+ b)`` (soft-capped by ``softcap``) against aligned
    ``targets``; returns a scalar fp32.

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
                chunk_size, backend, softcap=softcap,
            )  # fmt: skip
    _check(hidden, weight, targets, bias, reduction)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fused_linear_cross_entropy: softcap must be > 0, got {softcap}")
    H = hidden.shape[-1]
    h2 = hidden.reshape(-1, H).contiguous()  # (N, H)
    t2 = targets.reshape(-1).to(torch.int64).contiguous()  # (N,)
    if custom_ops.active():  # torch.compile: one graph node (see lorafuse.ops.custom_ops)
        if softcap is not None:
            raise NotImplementedError("fused_linear_cross_entropy: softcap under torch.compile "
                                      "is not supported (run it eagerly)")  # fmt: skip
        if is_quantized(weight):
            raise NotImplementedError("fused_linear_cross_entropy: a quantized head under "
                                      "torch.compile is not supported (run it eagerly)")  # fmt: skip
        return _compiled_loss(h2, weight, bias, t2, ignore_index, reduction, num_items_in_batch,
                              chunk_size, backend)  # fmt: skip
    V = weight.shape[0]
    valid = t2 != ignore_index
    scale = _grad_scale(t2, valid, V, ignore_index, reduction, num_items_in_batch)
    h2, t2 = _drop_ignored_rows(h2, t2, valid)
    budget = QUANTIZED_HEAD_CHUNK_BYTES if is_quantized(weight) else CHUNK_BYTES
    if softcap is not None:
        budget //= 2  # the tanh scratch is as large as the logits'
    chosen = backends.select("cross_entropy", hidden.device, backend)
    # the C++ chunk kernel reads a low-precision scratch in place; torch and Triton upcast a
    # chunk to fp32 around their math, so there the fp32 rule bounds the memory
    scratch_bytes = chunk_dtypes(h2)[1].itemsize if chosen == "cpp" else 4
    chunk = chunk_rows(h2.shape[0], V, chunk_size, budget, scratch_bytes)
    weight = weight if is_quantized(weight) else weight.contiguous()
    return FusedLinearCrossEntropyFunction.apply(
        h2, weight, bias, t2, int(ignore_index), scale, chunk, chosen,
        torch.is_grad_enabled(), None if softcap is None else float(softcap),
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
    chunk = chunk_rows(h2.shape[0], V, chunk_size)
    loss, grad_h, grad_w, grad_b = chunked(
        h2, weight.contiguous(), bias, t2, int(ignore_index), scale, chunk, chunk_dtypes(h2),
        backend, needs,
    )  # fmt: skip
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
    loss, *_grads = linear_cross_entropy_op(
        h2, weight.contiguous(), bias, t2, int(ignore_index), reduction, n_items, chunk_size,
        chosen, needs,
    )  # fmt: skip
    return loss


# --------------------------------------------------------------------------------------------
# The custom op (torch.compile; lorafuse.ops.custom_ops): the same kernels, one graph node.


@torch.library.custom_op("lorafuse::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ignore_index: int,
    reduction: str,
    num_items_in_batch: Tensor | None,
    chunk_size: int | None,
    backend: str,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss () fp32, grad_h (N, H), grad_w (V, H) fp32, grad_b (V,) fp32)``, each gradient a
    0-size tensor unless asked for in ``needs`` (hidden, weight, bias); targets (N,) int64."""
    n_items = None if num_items_in_batch is None else num_items_in_batch.item()
    loss, grads = loss_and_grads(hidden, weight, bias, targets, ignore_index, reduction,
                                   n_items, chunk_size, backend, needs)  # fmt: skip
    return loss, *(custom_ops.grad_or_empty(t, loss) for t in grads)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch, chunk_size,
      backend, needs):  # fmt: skip
    f32 = torch.float32
    shapes = ((hidden.shape, hidden.dtype), (weight.shape, f32), ((weight.shape[0],), f32))
    grads = (hidden.new_empty(s, dtype=dt) if need else hidden.new_empty(0, dtype=f32)
             for need, (s, dt) in zip(needs, shapes))  # fmt: skip
    return hidden.new_empty((), dtype=f32), *grads


def _ce_setup(ctx, inputs, output):
    _h, weight, bias, *_rest, needs = inputs
    ctx.save_for_backward(*output[1:])
    ctx.needs = needs
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)


def _ce_grad(ctx, g, *_unused):
    grad_h, grad_w, grad_b = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs
    dh = grad_h * g.to(grad_h.dtype) if need_h else None
    dw = (grad_w * g).to(ctx.dtypes[0]) if need_w else None
    db = (grad_b * g).to(ctx.dtypes[1]) if need_b else None
    return dh, dw, db, None, None, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_ce_grad, setup_context=_ce_setup)
