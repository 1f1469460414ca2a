"""Frozen weights stored for decoding, and their product with a few fp32 rows: ``y = x·Wᵀ``.

Decoding reads every weight once per step, so a step costs about the bytes of its weights. A
:class:`PackedWeight` holds one (N, K) weight in one of the formats of ``csrc/decode_gemv.h``:

* ``fp32``, ``bf16``, ``fp16``: the tensor as stored (the model's own, no copy);
* ``int8``: symmetric int8 codes with one fp32 scale per 32 consecutive weights of a row
  (``scale = absmax / 127``, ``code = round(w / scale)``): 1.125 bytes a weight, llama.cpp's q8_0
  groups with an fp32 scale;
* ``q4``: 4-bit codes, one fp32 scale per 32 weights (llama.cpp's q4_0 rule: ``scale`` = the
  group's value of largest magnitude / -8, ``code = clamp(round(w / scale) + 8, 0, 15)``, so the
  extreme maps to -8 exactly), 16 bytes of codes per group (byte i: weight i in the low nibble,
  weight i + 16 in the high one): 0.625 bytes a weight.

:func:`dequantize` is the reference (the weight the kernel multiplies, exactly), and
:func:`quant_linear_reference` the product: ``x.float() @ dequantize(w).T``. The C++ kernel
(``csrc/decode_gemv*.cpp``: AVX-512, AVX2 or plain C++ by CPU, dequantised in registers, fp32
sums) is what the decode engine calls for every projection; :func:`quant_linear` reaches it for
tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorafuse import backends

GROUP = 32  # weights per scale of int8 and q4
FORMATS = ("fp32", "bf16", "fp16", "int8", "q4")
# The kernel's format codes (csrc/decode_gemv.h WFmt).
FORMAT_CODES = {name: i for i, name in enumerate(FORMATS)}
_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PackedWeight:
    """One frozen (N, K) weight in format ``fmt``: ``data`` (the tensor itself for the plain
    formats; int8 codes (N, K); q4 uint8 codes (N, K // 2)) and ``scales`` ((N, K // 32) fp32,
    grouped formats only)."""

    fmt: str
    data: torch.Tensor
    scales: torch.Tensor | None
    shape: tuple[int, int]

    @property
    def code(self) -> int:
        return FORMAT_CODES[self.fmt]

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * 4)


def _check_grouped(weight: torch.Tensor, fmt: str) -> None:
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(
            f"{fmt} needs a 2-D weight with in_features % {GROUP} == 0, got {tuple(weight.shape)}"
        )


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """Symmetric int8 per group of 32 along each row (see the module docstring)."""
    _check_grouped(weight, "int8")
    N, K = weight.shape
    w = weight.detach().float().reshape(N, K // GROUP, GROUP)  # (N, groups, 32)
    scale = w.abs().amax(-1) / 127.0  # (N, groups)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return PackedWeight("int8", codes.reshape(N, K).contiguous(), scale.contiguous(), (N, K))


def quantize_q4(weight: torch.Tensor) -> PackedWeight:
    """4-bit per group of 32 along each row, llama.cpp's q4_0 rule (module docstring)."""
    _check_grouped(weight, "q4")
    N, K = weight.shape
    w = weight.detach().float().reshape(N, K // GROUP, GROUP)  # (N, groups, 32)
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)  # (N, groups), signed
    scale = extreme / -8.0
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(w * inv[..., None] + 8.0).clamp_(0, 15).to(torch.uint8)  # (N, groups, 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # (N, groups, 16)
    return PackedWeight("q4", packed.reshape(N, K // 2).contiguous(), scale.contiguous(), (N, K))


def pack(weight: torch.Tensor, fmt: str) -> PackedWeight:
    """``weight`` (N, K) in format ``fmt``; the plain formats keep the tensor itself when it
    already has that dtype and is contiguous (no copy)."""
    if fmt == "int8":
        return quantize_int8(weight)
    if fmt == "q4":
        return quantize_q4(weight)
    if fmt not in _PLAIN:
        raise ValueError(f"unknown weight format {fmt!r}: one of {', '.join(FORMATS)}")
    data = weight.detach().to(_PLAIN[fmt]).contiguous()
    return PackedWeight(fmt, data, None, tuple(weight.shape))


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The (N, K) fp32 weight the kernel multiplies."""
    N, K = w.shape
    if w.fmt in _PLAIN:
        return w.data.float()
    if w.fmt == "int8":
        codes = w.data.float().reshape(N, K // GROUP, GROUP)
    else:
        b = w.data.reshape(N, K // GROUP, 16)
        codes = torch.cat([b & 15, b >> 4], -1).float() - 8.0  # (N, groups, 32)
    return (codes * w.scales[..., None]).reshape(N, K)


def quant_linear_reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """``x (M, K) · Wᵀ`` in fp32: (M, N)."""
    return x.float() @ dequantize(w).T


def quant_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """``x (M, K) · Wᵀ`` in fp32 by the C++ kernel where ``backends`` chooses it (op
    ``decode_engine``), else the reference."""
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be (M, {w.shape[1]}), got {tuple(x.shape)}")
    if backends.select_cpu("decode_engine") != "cpp" or not x.is_cpu:
        return quant_linear_reference(x, w)
    (kernel,) = backends.compiled("decode_engine", "cpp", "quant_linear")
    return kernel(x, w.code, w.data, w.scales, w.shape[0])


def decoder_class():
    """The C++ decoder step's class (``csrc/decode_engine_bind.cpp``) that
    :class:`lorafuse.decode.DecodeEngine` drives: this op's formats are its weights."""
    (cls,) = backends.compiled("decode_engine", "cpp", "model")
    return cls


def products_isa() -> str:
    """Which body the products run on this CPU: avx512, avx2 or scalar."""
    return backends.compiled("decode_engine", "cpp", "gemv_isa")[0]()
