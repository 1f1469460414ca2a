"""NF4 (4-bit NormalFloat) storage format: quantiser and the plain torch dequantiser.

Storage format (per weight of ``n = out*in`` elements, flattened row-major):

* ``codes``  (ceil(n/64)*32,) uint8 -- two 4-bit indices into :data:`NF4_CODE` per byte, the
  *first* element in the high nibble (bitsandbytes' packing, so its CUDA kernel can read it).
* absmax of each block of 64 weights, double-quantised: ``absmax ≈ q * scale[block256] + offset``
  with ``q`` (ceil(n/64) padded to 256,) int8, ``scale`` (blocks of 256 absmaxes,) fp32 and
  ``offset`` () fp32 (the mean absmax). That is 1 byte per 64 weights instead of 4: the whole
  format costs 0.5 + 1/64 + 4/16384 ≈ 0.516 bytes per weight, 0.258x of bf16.

bitsandbytes double-quantises the absmax with an 8-bit *dynamic* code; we use a symmetric linear
int8 code per 256-block of the centred absmax (equivalent size, simpler, relative absmax error
<= 1/254 of the block's spread).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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
