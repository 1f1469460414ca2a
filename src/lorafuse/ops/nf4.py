"""NF4 (4-bit NormalFloat) weights: the storage format, its quantiser and the dequantise /
decode kernels with their torch reference.

Per weight of n = out*in elements: ``codes`` (ceil(n/64)*32,) uint8, two 4-bit indices into
:data:`NF4_CODE` per byte, first element in the high nibble (bitsandbytes' packing); the absmax
of each block of 64, double-quantised per 256 blocks (``absmax_q`` int8, ``absmax_scale`` fp32,
``absmax_offset`` fp32): ≈ 0.516 bytes a weight. The policy block below chooses the kernel
(op ``nf4_dequantize``) through :mod:`lorafuse.backends`. Format and kernels: docs/kernels.md.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from lorafuse import backends
from lorafuse.ops.weights import dense_buffer

BLOCK = 64  # weights per absmax (bitsandbytes' QLoRA default)
BLOCK2 = 256  # absmaxes per double-quantisation scale

# The NF4 code: quantiles of N(0, 1) normalised to [-1, 1] with an exact zero (Dettmers et al.,
# QLoRA, 2023); bitsandbytes' `get_4bit_type("nf4")` values, index = the 4-bit code.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


# ---- Policy: which NF4 kernel runs (the family: backends.select, op nf4_dequantize) ------
# Output dtypes the C++ dequantiser writes; others (float64) take the torch code.
CPP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Decoding (a few rows, no gradient to carry: one new token per sequence) multiplies straight
# from the codes (csrc/decode_linear.cpp: dequantised in registers on AVX-512, else a tile of rows
# in cache; bit-identical values) instead of writing and reading back a dense copy of the whole
# weight for every token.
DECODE_MAX_ROWS = 8  # the kernel's limit; 0 turns the path off (benchmarks/ops/nf4.py --decode)


def dequantizer(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Which dequantiser runs on ``device`` for output ``dtype``: ``bitsandbytes`` (CUDA, where it
    is installed and verified), ``cpp`` (lorafuse's C++ kernel on CPU, chosen by
    :func:`lorafuse.backends.select` like every op: ``LORAFUSE_KERNELS=torch`` keeps torch) or
    ``torch`` (:func:`dequantize_nf4`). The choice is recorded in :func:`lorafuse.backends.choices`.
    """
    if device.type == "cuda":
        if _bnb_dequantizer(device.index or 0) is not None:
            return backends.record(
                "nf4_dequantize", device, "bitsandbytes", "CUDA kernel, verified"
            )
        why = "bitsandbytes not installed or failed its check"
        return backends.record("nf4_dequantize", device, "torch", why)
    if device.type != "cpu":
        return backends.record("nf4_dequantize", device, "torch", f"no kernel for {device.type}")
    # There is no Triton NF4 kernel for CPU tensors: a Triton request keeps auto's choice here.
    override = "auto" if backends.requested() == "triton" else None
    if dtype in CPP_DTYPES:  # asked per weight per call: select_cpu caches the answer
        return backends.select_cpu("nf4_dequantize", override)
    return backends.select(
        "nf4_dequantize", device, override, unsupported=f"NF4 dequantisation to {dtype}"
    )


def dequantizer_name(device: torch.device | str) -> str:
    """Which NF4 dequantiser runs on ``device``: ``bitsandbytes`` (CUDA, if it works), ``lorafuse
    C++`` (CPU, the extension built) or ``lorafuse`` (the torch code)."""
    names = {"bitsandbytes": "bitsandbytes", "cpp": "lorafuse C++", "torch": "lorafuse"}
    return names[dequantizer(torch.device(device))]


def decodes(x: torch.Tensor, weight, bias: torch.Tensor | None) -> bool:
    """Whether ``x·Wᵀ + b`` runs as :func:`decode_linear` (dtype and shape the kernel takes)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (
        1 <= rows <= DECODE_MAX_ROWS
        and not (torch.is_grad_enabled() and x.requires_grad)
        and x.dtype in (torch.bfloat16, torch.float16)
        and (bias is None or bias.dtype == x.dtype)
        and weight.shape[1] % BLOCK == 0
        and dequantizer(x.device, x.dtype) == "cpp"
    )


# ---- The format: quantiser and torch reference ----------------------------------------------


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code (16,), midpoints (15,), pair table (256, 2)) fp32 on ``device``.

    The pair table maps a packed byte straight to its two values: one gather per byte instead of
    two shifts, a stack and a gather per nibble.
    """
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    mids = (code[1:] + code[:-1]) / 2
    byte = torch.arange(256, device=device)
    pairs = torch.stack([code[byte >> 4], code[byte & 15]], dim=1)  # (256, 2)
    return code, mids, pairs


def quantize_nf4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantise a dense ``(out, in)`` weight; returns the buffers of the format above."""
    if weight.dim() != 2:
        raise ValueError(f"NF4 quantises 2-D weights, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"NF4 quantises floating-point weights, got {weight.dtype}")
    w = weight.detach().reshape(-1).float()  # (n,)
    n = w.numel()
    nb = -(-n // BLOCK)
    w = F.pad(w, (0, nb * BLOCK - n)).view(nb, BLOCK)  # zero padding leaves each absmax unchanged
    absmax = w.abs().amax(dim=1)  # (nb,)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    _, mids, _ = _tables(w.device)
    idx = (
        torch.bucketize(w / safe[:, None], mids).to(torch.uint8).view(-1)
    )  # nearest code, (nb*64,)
    codes = (idx[0::2] << 4) | idx[1::2]  # (nb*32,) first element high nibble
    return {"codes": codes, **_quantize_absmax(absmax)}


def _quantize_absmax(absmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """Double quantisation: int8 codes of ``absmax - mean`` with one fp32 scale per 256 blocks."""
    offset = absmax.mean()
    nb = absmax.numel()
    nb2 = -(-nb // BLOCK2)
    centred = F.pad(absmax - offset, (0, nb2 * BLOCK2 - nb)).view(nb2, BLOCK2)
    scale = centred.abs().amax(dim=1) / 127.0  # (nb2,)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(centred / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)
    return {"absmax_q": q, "absmax_scale": scale, "absmax_offset": offset}


def dequantize_absmax(absmax_q, absmax_scale, absmax_offset, n_blocks: int) -> torch.Tensor:
    """The fp32 absmax per 64-block, (n_blocks,)."""
    q = absmax_q.view(-1, BLOCK2).float()  # (nb2, 256)
    return (q * absmax_scale[:, None] + absmax_offset).view(-1)[:n_blocks]


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 code values of packed ``codes`` (two 4-bit indices per byte, the first in the high
    nibble), in order: ``(codes.numel() * 2,)``, not yet scaled by their absmax."""
    _, _, pairs = _tables(codes.device)
    # index_select with int32 indices: measured 1.7x faster than pairs[codes.long()] on CPU.
    return pairs.index_select(0, codes.reshape(-1).int()).view(-1)


def dequantize_nf4(codes, absmax_q, absmax_scale, absmax_offset, shape, dtype) -> torch.Tensor:
    """Dense ``shape`` tensor in ``dtype`` from the NF4 buffers (vectorised torch, any device)."""
    n = shape[0] * shape[1]
    nb = codes.numel() * 2 // BLOCK
    absmax = dequantize_absmax(absmax_q, absmax_scale, absmax_offset, nb)  # (nb,)
    values = code_values(codes).view(nb, BLOCK)  # (nb, 64) fp32
    values.mul_(absmax[:, None])
    return values.view(-1)[:n].view(shape).to(dtype)


def dequantize_nf4_columns(codes, absmax_q, absmax_scale, absmax_offset, shape, start, stop, dtype):
    """Columns ``start:stop`` of :func:`dequantize_nf4`'s ``shape`` tensor, (rows, stop - start),
    the same values bit for bit; ``shape[1]``, ``start`` and ``stop`` multiples of :data:`BLOCK`
    (each row holds whole blocks)."""
    rows, cols = shape
    per_row = cols // BLOCK
    absmax = dequantize_absmax(absmax_q, absmax_scale, absmax_offset, rows * per_row)
    absmax = absmax.view(rows, per_row)[:, start // BLOCK : stop // BLOCK]  # (rows, nb)
    codes = codes[: rows * cols // 2].view(rows, cols // 2)[:, start // 2 : stop // 2]
    values = code_values(codes).view(rows, -1, BLOCK)  # (rows, nb, 64) fp32
    values.mul_(absmax[..., None])
    return values.view(rows, stop - start).to(dtype)


# ---- bitsandbytes (CUDA) -------------------------------------------------------------------


@functools.cache
def _bnb_dequantizer(device_index: int):
    """bitsandbytes' CUDA NF4 dequantisation kernel, if installed and verified here; else None."""
    try:
        import bitsandbytes.functional as bnbf
    except Exception:  # not installed, or a broken build raising at import
        return None
    device = torch.device("cuda", device_index)
    try:
        w = torch.randn(96, 200, device=device)
        buf = quantize_nf4(w)
        ours = dequantize_nf4(**buf, shape=w.shape, dtype=torch.float32)
        theirs = _bnb_call(bnbf, _buffers(buf), w.shape, torch.float32)
        if not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"max diff {(ours - theirs).abs().max().item():.3e} vs lorafuse NF4")
    except Exception as err:
        warnings.warn(
            f"lorafuse: bitsandbytes NF4 dequantisation unusable ({err}); using lorafuse's",
            stacklevel=3,
        )
        return None
    return bnbf


def _bnb_call(bnbf, buf, shape, dtype):
    codes, absmax_q, absmax_scale, absmax_offset = buf
    nb = codes.numel() * 2 // BLOCK
    absmax = dequantize_absmax(absmax_q, absmax_scale, absmax_offset, nb)
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    bnbf.dequantize_4bit(
        codes.view(-1, 1), absmax=absmax, out=out, blocksize=BLOCK, quant_type="nf4"
    )
    return out


# ---- Entry points ----------------------------------------------------------------------------


def _buffers(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, absmax_q, absmax_scale, absmax_offset)`` of a weight object or of
    :func:`quantize_nf4`'s dict."""
    if isinstance(w, dict):
        return w["codes"], w["absmax_q"], w["absmax_scale"], w["absmax_offset"]
    return w.codes, w.absmax_q, w.absmax_scale, w.absmax_offset


def dequantize(weight, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``weight.shape`` copy in ``dtype`` by the kernel :func:`dequantizer` picks; transient
    by design (the C++ kernel writes into :func:`~lorafuse.ops.weights.dense_buffer`)."""
    buf = _buffers(weight)
    device = buf[0].device
    impl = dequantizer(device, dtype)
    if impl == "bitsandbytes":
        return _bnb_call(_bnb_dequantizer(device.index or 0), buf, weight.shape, dtype)
    if impl == "cpp":
        (forward,) = backends.compiled("nf4_dequantize", "cpp", "forward")
        out = dense_buffer(weight.shape, dtype, device)  # (out, in); reused once free
        forward(*buf, out)
        return out
    return dequantize_nf4(*buf, weight.shape, dtype)


def dequantize_columns(weight, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense columns ``start:stop`` (out, stop - start) in ``dtype``, the values of
    :func:`dequantize` bit for bit; ``weight.shape[1]``, ``start`` and ``stop`` multiples of
    :data:`BLOCK` (the caller checks)."""
    buf = _buffers(weight)
    if dequantizer(buf[0].device, dtype) == "cpp":
        (columns,) = backends.compiled("nf4_dequantize", "cpp", "columns")
        out = dense_buffer((weight.shape[0], stop - start), dtype, buf[0].device)
        columns(*buf, weight.shape[1], start, stop, out)
        return out
    return dequantize_nf4_columns(*buf, weight.shape, start, stop, dtype)


def decode_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` through ``nf4_decode_linear`` (where :func:`decodes`); x keeps its
    leading dims."""
    (kernel,) = backends.compiled("nf4", "cpp", "decode_linear")
    return kernel(x.contiguous(), *_buffers(weight), weight.shape[0], bias)
