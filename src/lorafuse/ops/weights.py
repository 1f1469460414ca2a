"""Base weights as the fused ops see them: a dense Tensor, or a quantized weight object.

A quantized base weight (e.g. NF4, see :mod:`lorafuse.models.nf4`) is any object with
``.shape`` (out, in) and ``.dequantize(dtype) -> Tensor``. The fused ops dequantize it in forward
*and* backward, so no dense copy is saved for backward. One that also has ``.rows(start, stop)``
and ``.row_alignment`` can be walked in blocks of rows (:func:`row_blocks`: a quantized vocabulary
head); one that also has ``.dequantize_columns(start, stop, dtype)`` and ``.column_alignment``
is multiplied tile by tile where its dense copy would be larger than a tile (:func:`tiled`): the
frozen products :func:`frozen_linear` (row tiles, a block of output columns each) and
:func:`frozen_input_grad` (column tiles, a block of input-gradient columns each), so QLoRA holds
no dense copy larger than :data:`TILE_BYTES` at any time. One that has its own frozen products
(``.linear(x, bias)`` and ``.input_grad(g, into)``: int8, :mod:`lorafuse.models.int8`) is never
made dense by them: :func:`own_products`.

Dequantisers write those transient copies into :func:`dense_buffer`. Where lorafuse's
large-buffer allocator serves the size (:mod:`lorafuse.heap`, installed by the CPU training heap policy) that
is a plain allocation: the allocator hands a freed buffer of the same size back. Elsewhere it is
a buffer kept per size, handed out again once nothing holds its storage any more: a fresh
allocation per copy fragments glibc's heap when it keeps freed buffers for reuse (+530 MiB peak
on a Llama-3.2-1B NF4 step at 1 x 512, ``benchmarks/probes/heap_peak.py``) and page-faults when
it does not.
"""

from __future__ import annotations

import math
import threading

import torch

from lorafuse import heap

# ---- Policy: tile and buffer sizes for quantized weights (tiled() applies them) ----------
# Bytes of one dense tile of a quantized weight: a block of rows (a vocabulary head walked by
# rows, 1024 rows of a 2048-wide bf16 head; a projection's forward) or of columns (its backward).
# At the fused loss of a Llama-3.2-1B NF4 step (1 x 512) the head's block is alive beside the
# logits chunk and every checkpointed layer input, the step's peak: 32 MiB blocks put 53 MiB more
# there (`benchmarks/probes/peak_by_op.py`). One block is still a (rows x 2048) x (2048 x 1024)
# product.
ROW_BLOCK_BYTES = 4 << 20
# Bytes of one dense tile of a quantized projection in the fused ops (:func:`tiled`). Llama-3.2-1B
# shapes, NF4, 512 tokens, fwd + bwd against one whole dense copy (benchmarks/probes/nf4_tiles.py,
# 2 threads, medians of 7, AVX-512-BF16 EPYC): MLP 0.85x / 0.93x / 0.97x / 0.96x at 2 / 4 / 8 /
# 16 MiB, Q/K/V 0.91x / 0.96x / 1.01x / 0.99x. In the whole Llama-3.2-1B QLoRA step (lorafuse
# bench --quant nf4, 1 x 512) 8 MiB peaked 12 MiB higher (1414 vs 1402 MiB) with no step-time
# gain outside the noise (NF4 linears 0.87x vs 0.88x of bf16), so 4 MiB.
TILE_BYTES = 4 << 20
# A quantized weight whose dense copy would be larger than this is walked in row blocks even by a
# plain forward (Linear4bit: generation, an unpatched loss over a quantized head); there the
# largest projections of a 1B model (8192 x 2048 bf16, 32 MiB) are dequantized whole (the fused
# ops, training, take them in tiles).
WALK_ABOVE_BYTES = 64 << 20

# Buffers kept per (numel, dtype, device): the fused ops hold one dense copy at a time (their
# ``peak_alive`` tests) and the head walk frees each block before the next; a second copy alive
# at once is a plain allocation. Two per size measured 10 MiB more peak and no faster
# (Llama-3.2-1B NF4 1 x 512, `benchmarks/probes/heap_peak.py`).
BUFFERS_PER_SIZE = 1
# Larger copies are not kept (one projection of a 70B model is 448 MiB in bf16): a rare size is
# not worth holding between steps.
KEEP_MAX_BYTES = 256 << 20

_buffers: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
_lock = threading.Lock()  # a free buffer is claimed (viewed) under the lock: no two takers


def _storage_users(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# What _storage_users reads for a tensor nothing else shares (the probe's own reference included).
_UNSHARED = _storage_users(torch.empty(1))


def is_quantized(weight) -> bool:
    return not isinstance(weight, torch.Tensor)


def materialize(weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``(out, in)`` weight in ``dtype``: the tensor itself, or a transient dequantized copy."""
    if isinstance(weight, torch.Tensor):
        return weight
    return weight.dequantize(dtype)


def row_blocks(weight, dtype: torch.dtype, block_bytes: int | None = None):
    """``(start, stop, dense rows start:stop)`` covering a quantized ``weight`` in ``dtype``,
    about ``block_bytes`` each, each dense block transient (only one alive if the caller keeps
    none)."""
    n_rows, n_cols = weight.shape
    for start, stop in _spans(n_rows, n_cols * dtype.itemsize, weight.row_alignment, block_bytes):
        yield start, stop, weight.rows(start, stop).dequantize(dtype)


def column_blocks(weight, dtype: torch.dtype, block_bytes: int | None = None):
    """``(start, stop, dense columns start:stop)`` covering a quantized ``weight`` in ``dtype``,
    about ``block_bytes`` each (whole multiples of its ``column_alignment``), each transient."""
    n_rows, n_cols = weight.shape
    align = weight.column_alignment
    for start, stop in _spans(n_cols, n_rows * dtype.itemsize, align, block_bytes):
        yield start, stop, weight.dequantize_columns(start, stop, dtype)


def _spans(n: int, unit_bytes: int, align: int, block_bytes: int | None):
    """``(start, stop)`` over ``n`` rows (or columns) of ``unit_bytes`` each: blocks of about
    ``block_bytes`` (default :data:`ROW_BLOCK_BYTES`), whole multiples of ``align`` (at least one)."""
    step = max(align, (block_bytes or ROW_BLOCK_BYTES) // unit_bytes // align * align)
    for start in range(0, n, step):
        yield start, min(n, start + step)


def own_products(weight) -> bool:
    """Whether ``weight`` runs its own frozen products (``.linear``, ``.input_grad``)."""
    return is_quantized(weight) and hasattr(weight, "input_grad")


def tiled(weight, dtype: torch.dtype) -> bool:
    """Whether the fused ops multiply by ``weight`` tile by tile (:func:`frozen_linear`,
    :func:`frozen_input_grad`) instead of through one dense copy: a quantized CPU weight that
    offers row and column tiles (``rows``, ``dequantize_columns``, a ``column_alignment``) and
    whose dense copy in ``dtype`` would be larger than one tile (:data:`TILE_BYTES`).
    Elsewhere (CUDA: bitsandbytes dequantizes whole weights) one projection's dense copy is
    alive at a time. A weight with :func:`own_products` takes the same route (never dense)."""
    if own_products(weight):
        return True
    return (
        is_quantized(weight)
        and getattr(weight, "column_alignment", None) is not None
        and hasattr(weight, "rows")
        and weight.device.type == "cpu"
        and weight.shape.numel() * dtype.itemsize > TILE_BYTES
    )


def linear_by_row_blocks(x: torch.Tensor, weight, bias=None, dtype=None, block_bytes=None):
    """``x (n, in) · Wᵀ (+ b)`` -> ``(n, out)`` in x's dtype for a quantized ``W`` walked in row
    blocks (of ``block_bytes``, default :data:`ROW_BLOCK_BYTES`), each dequantized in ``dtype``
    (default x's) and cast to x's: each output column block one GEMM (``addmm`` with the bias, as
    ``F.linear``), each element the whole row's product."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for start, stop, w in row_blocks(weight, dtype or x.dtype, block_bytes):
        w = w.to(x.dtype)
        if bias is None:
            torch.mm(x, w.t(), out=out[:, start:stop])
        else:
            torch.addmm(bias[start:stop].to(x.dtype), x, w.t(), out=out[:, start:stop])
        del w  # its buffer is free for the next block (dense_buffer)
    return out


def frozen_linear(x: torch.Tensor, weight, bias, dtype: torch.dtype) -> torch.Tensor:
    """The frozen product ``x (N, d) · Wᵀ (+ b)`` -> ``(N, k)`` in x's dtype, ``W`` dense or
    quantized (dequantized in ``dtype``, what a dense W would hold, then cast to x's dtype):
    its own products where it has them, by row tiles where :func:`tiled`, else through one dense
    copy."""
    if own_products(weight):
        return weight.linear(x, bias)
    if tiled(weight, dtype):
        return linear_by_row_blocks(x, weight, bias, dtype, TILE_BYTES)
    wt = materialize(weight, dtype).to(x.dtype).t()  # (d, k) view; transient if quantized
    return x @ wt if bias is None else torch.addmm(bias.to(x.dtype), x, wt)


def frozen_input_grad(g: torch.Tensor, weight, dtype: torch.dtype, into=None) -> torch.Tensor:
    """``g (N, k) · W`` -> ``(N, d)`` in g's dtype, ``W`` as in :func:`frozen_linear`: written
    into a new tensor, or added into ``into`` (the sum over projections of one input). By
    column tiles where :func:`tiled` (each a block of dx's columns, each element the whole
    product), else through one dense copy; a weight's own products where it has them."""
    if own_products(weight):
        return weight.input_grad(g, into)
    if tiled(weight, dtype):
        add = into is not None
        if not add:
            into = torch.empty(g.shape[0], weight.shape[1], dtype=g.dtype, device=g.device)
        for start, stop, w in column_blocks(weight, dtype, TILE_BYTES):
            w, dx = w.to(g.dtype), into[:, start:stop]  # (k, tile), (N, tile)
            if add:
                _add_product(dx, g, w)
            else:
                torch.mm(g, w, out=dx)
            del w  # its buffer is free for the next tile
        return into
    w = materialize(weight, dtype).to(g.dtype)  # (k, d)
    if into is None:
        return g @ w
    return _add_product(into, g, w)


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out += a·b``: accumulated by the GEMM in fp32; a bf16 addmm_ into out ran 5.96 ms vs
    4.46 ms + 0.53 ms for mm + add_ (2048x1536 @ 1536x576, 1 thread, AMX Xeon), so low precision adds a product formed apart (one rounding each, as before tiles)."""
    if out.dtype == torch.float32:
        return out.addmm_(a, b)
    return out.add_(a @ b)


def input_grad_by_row_blocks(g: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    """``g (n, out) · W`` -> ``(n, in)`` fp32 for a quantized ``W`` walked in row blocks, each
    dequantized in ``dtype`` (what a dense W would hold) and multiplied in g's dtype (rounded
    once per block), the blocks summed in fp32."""
    out = torch.zeros(g.shape[0], weight.shape[1], dtype=torch.float32, device=g.device)
    for start, stop, w in row_blocks(weight, dtype):
        out += g[:, start:stop].contiguous() @ w.to(g.dtype)  # contiguous: measured faster (MKL)
        del w
    return out


def dense_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised ``shape`` tensor for a transient dense copy: a plain allocation where the
    large-buffer allocator serves its size; else a kept buffer of that size nothing else holds
    (no view, no saved tensor), else a new allocation (kept while fewer than
    :data:`BUFFERS_PER_SIZE` of its size exist and it is at most :data:`KEEP_MAX_BYTES`)."""
    numel = math.prod(shape)
    if torch.device(device).type == "cpu" and _from_large_buffers(numel * dtype.itemsize):
        return torch.empty(shape, dtype=dtype, device=device)  # its allocator keeps freed ones
    key = (numel, dtype, torch.device(device))
    with _lock:
        kept = _buffers.setdefault(key, [])
        for buf in kept:
            if _storage_users(buf) == _UNSHARED:
                return buf.view(shape)
        buf = torch.empty(numel, dtype=dtype, device=device)
        if len(kept) < BUFFERS_PER_SIZE and numel * dtype.itemsize <= KEEP_MAX_BYTES:
            kept.append(buf)
        return buf.view(shape)


def _from_large_buffers(nbytes: int) -> bool:
    """Whether lorafuse's large-buffer allocator (:mod:`lorafuse.heap`) serves ``nbytes``: it
    already reuses freed buffers by size, without the fragmentation a kept one works around."""
    return 0 < heap.large_buffers_from() <= nbytes


def release_dense_buffers() -> None:
    """Drop the kept buffers (e.g. after training, before loading another model)."""
    with _lock:
        _buffers.clear()
