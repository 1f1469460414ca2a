"""The chunk loop of the fused linear cross-entropy (:mod:`lorafuse.ops.cross_entropy`) and the
chunk kernel of each backend.

:func:`chunked` walks hidden (N, H) in chunks of ``chunk`` rows against weight (V, H): per chunk
one GEMM writes the logits into a (chunk, V) scratch allocated once per call (a quantized head:
one GEMM per dequantized block of rows), the chunk kernel turns them in place into
``d loss / d logits`` (times ``1 - tanh²`` under ``softcap``), and the gradients of hidden,
weight and bias are accumulated right there. The chunk kernels: torch
(:func:`torch_chunk_forward_backward` on fp32 logits, :func:`torch_chunk_forward_backward_lowp`
on bf16/fp16 ones), ``cpp`` (``csrc/cross_entropy.cpp``), ``triton`` (``triton/cross_entropy.py``,
fp32 only: low-precision logits are upcast around it). ``ops/token_logprobs.py`` runs the same
kernels.

Why a file of its own: this is the body that both paths of the op run (its
``autograd.Function`` in eager, the ``lorafuse::linear_cross_entropy`` custom op under
``torch.compile``), and together they would not fit one file. ``ops/cross_entropy.py`` keeps
the op: its policy block (rows per chunk, the scratch's dtype, passed in here), the reference,
the autograd.Function, the checks, the entry point and the custom op. Exactness and memory: that
module's docstring. This module imports no other op.
"""

from __future__ import annotations

import torch

from lorafuse import backends
from lorafuse.ops.weights import input_grad_by_row_blocks, is_quantized, row_blocks


def torch_chunk_forward_backward(logits, targets, ignore_index, grad_scale):
    """The chunk kernel (every backend implements it). ``logits`` (n, V) fp32 becomes
    ``grad_scale·(softmax - onehot)`` in place (zero rows where ``targets == ignore_index``);
    returns the per-row loss (n,) fp32."""
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


def torch_chunk_forward_backward_lowp(logits, targets, ignore_index, grad_scale):
    """The low-precision chunk kernel (reference of ``..._lowp`` in C++). ``logits`` (n, V) bf16
    or fp16, the native GEMM's output, becomes ``grad_scale·(softmax - onehot)`` rounded to its
    dtype once, in place; the math is :func:`torch_chunk_forward_backward` on ``logits.float()``
    (HF's upcast before the log-sum-exp). Returns the per-row loss (n,) fp32."""
    work = logits.float()  # (n, V) fp32: the one transient the C++ kernel does without
    loss = torch_chunk_forward_backward(work, targets, ignore_index, grad_scale)
    logits.copy_(work)
    return loss


def implementation(backend: str):
    """The fp32 chunk kernel of ``backend``: fp32 logits (n, V) in place (see the torch one)."""
    if backend == "torch":
        return torch_chunk_forward_backward
    return backends.compiled("cross_entropy", backend, "chunk_forward_backward")[0]


def lowp_implementation(backend: str):
    """The bf16/fp16 chunk kernel of ``backend`` (see :func:`torch_chunk_forward_backward_lowp`).

    Triton has only the fp32 kernel: its low-precision logits are upcast around it, as the torch
    reference does (one (n, V) fp32 transient per chunk, what this op did before on every
    backend)."""
    if backend == "torch":
        return torch_chunk_forward_backward_lowp
    if backend == "cpp":
        return backends.compiled("cross_entropy", "cpp", "chunk_forward_backward_lowp")[0]
    fp32_kernel = implementation(backend)

    def upcast(logits, targets, ignore_index, grad_scale):
        work = logits.float()  # (n, V)
        loss = fp32_kernel(work, targets, ignore_index, grad_scale)
        logits.copy_(work)
        return loss

    return upcast


def _logits_into(out, h, w_mm, b):
    """``out`` (n, V) <- ``h (n, H) · w_mmᵀ (+ b)``: one GEMM into the scratch where ``out`` has
    the product's dtype (with the bias added as ``F.linear`` adds it), else (float64 models) the
    product upcast as ``.float()`` would."""
    if out.dtype == h.dtype:
        if b is None:
            torch.mm(h, w_mm.t(), out=out)
        else:
            torch.addmm(b, h, w_mm.t(), out=out)
        return
    out.copy_(h @ w_mm.t())
    if b is not None:
        out += b


def _head_logits(g, h, weight, w_mm, b_mm, dense_dtype) -> None:
    """``g`` (n, V) <- the logits of ``h`` (n, H): one GEMM with the dense ``w_mm``, or (a
    quantized head, ``w_mm`` None) one per block of rows dequantized in turn into its columns:
    in ``dense_dtype`` (the dense head's), then cast to h's product dtype as ``w_mm`` is."""
    if w_mm is not None:
        _logits_into(g, h, w_mm, b_mm)
        return
    for start, stop, w in row_blocks(weight, dense_dtype):
        w = w.to(h.dtype)  # a copy only where the product dtype differs (fp32 products on AVX2)
        _logits_into(g[:, start:stop], h, w, None if b_mm is None else b_mm[start:stop])
        del w  # its buffer is free for the next block (ops.weights.dense_buffer)


def chunked(hidden, weight, bias, targets, ignore_index, grad_scale, chunk, dtypes, backend,
            needs, softcap=None):  # fmt: skip
    """The chunk loop: ``(loss () fp32, grad_h (N, H) | None, grad_w (V, H) fp32 | None,
    grad_b (V,) fp32 | None)``, gradients only where ``needs`` (hidden, weight, bias) says.

    ``chunk`` rows per chunk and ``dtypes`` = (GEMM dtype, scratch dtype) are the op's policy
    (``ops/cross_entropy.py``: ``chunk_rows``, ``chunk_dtypes``)."""
    need_h, need_w, need_b = needs
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    mm, sdt = dtypes
    kernel = implementation(backend) if sdt == torch.float32 else lowp_implementation(backend)
    # (V, H); a transient copy only where low precision is slow (CPU); a quantized head stays
    # quantized and is dequantized block by block inside each product (ops.weights.row_blocks)
    w_mm = None if is_quantized(weight) else weight.to(mm)
    b_mm = None if bias is None else bias.to(sdt)  # added in the GEMM's output dtype
    grad_h = torch.empty(N, H, dtype=hidden.dtype, device=dev) if need_h else None  # out= rows
    grad_w = torch.zeros(V, H, dtype=torch.float32, device=dev) if need_w else None
    grad_b = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None
    total = torch.zeros((), dtype=torch.float32, device=dev)
    # One (chunk, V) scratch for every chunk: a fresh (n, V) tensor per chunk page-faults its
    # 64-128 MiB in again each time (glibc mmaps allocations that large).
    scratch = torch.empty(min(chunk, N), V, dtype=sdt, device=dev)
    tanh = torch.empty_like(scratch) if softcap is not None else None  # (chunk, V)
    for s in range(0, N, chunk):
        h = hidden[s : s + chunk].to(mm)  # (n, H)
        g = scratch[: h.shape[0]]  # (n, V): the logits, then d loss / d logits
        _head_logits(g, h, weight, w_mm, b_mm, hidden.dtype)
        if tanh is not None:  # HF's three ops, each rounded to the logits dtype
            t = tanh[: h.shape[0]]  # (n, V)
            torch.div(g, softcap, out=t).tanh_()
            torch.mul(t, softcap, out=g)
        total += kernel(g, targets[s : s + chunk], ignore_index, grad_scale).sum()
        if tanh is not None:  # d softcap·tanh(z / softcap) / dz = 1 - tanh²
            g.mul_(t.mul_(t).neg_().add_(1.0))
        # `g` now holds d loss / d logits (already scaled by grad_scale), in the scratch dtype.
        g_mm = g if sdt == mm else g.to(mm)  # (n, V); a cast only for float64 models
        if need_h and w_mm is None:
            # block products rounded to mm, summed in fp32 (the dense path rounds the sum once)
            grad_h[s : s + chunk] = input_grad_by_row_blocks(g_mm, weight, hidden.dtype)
        elif need_h:
            if grad_h.dtype == mm:
                torch.mm(g_mm, w_mm, out=grad_h[s : s + chunk])  # (n, H)
            else:
                grad_h[s : s + chunk] = g_mm @ w_mm  # bf16 on AVX2: fp32 product, stored bf16
        if need_w:
            if mm == torch.float32:
                grad_w.addmm_(g_mm.t(), h)  # (V, H) fp32 accumulation
            else:
                grad_w += g_mm.t() @ h
        if need_b:
            grad_b += g.sum(0, dtype=torch.float32)  # (V,)
        del g_mm
    return total * grad_scale, grad_h, grad_w, grad_b
