"""NF4 (4-bit NormalFloat) base weights for QLoRA: weight object, ``Linear4bit``, model quantiser.

The storage format, its quantiser and the dequantise / decode kernels (and which of them runs):
:mod:`lorafuse.ops.nf4`. :class:`NF4Weight` is the quantized weight object of
:mod:`lorafuse.ops.weights`: ``.shape``, ``.dtype``, ``.device``, ``.dequantize(dtype)``; it is
dequantized in forward and again in backward, the dense copy never kept. The fused ops take a
CPU weight larger than a tile in tiles (:func:`lorafuse.ops.weights.tiled`): blocks of rows
(:meth:`NF4Weight.rows`) in forward, of columns (:meth:`NF4Weight.dequantize_columns`, the same
values bit for bit) in backward.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from lorafuse.ops import nf4 as kernels
from lorafuse.ops import weights
from lorafuse.ops.nf4 import BLOCK, BLOCK2, quantize_nf4


class NF4Weight:
    """A quantized base weight (see :mod:`lorafuse.ops.weights`): views of a Linear4bit's buffers."""

    def __init__(self, codes, absmax_q, absmax_scale, absmax_offset, shape, dtype):
        self.codes, self.absmax_q = codes, absmax_q
        self.absmax_scale, self.absmax_offset = absmax_scale, absmax_offset
        self.shape = torch.Size(shape)
        self.dtype = dtype  # the compute dtype: what dequantize() returns by default
        self.requires_grad = False

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense ``(out, in)`` copy in ``dtype`` (default the compute dtype); transient by design."""
        return kernels.dequantize(self, dtype or self.dtype)

    @property
    def row_alignment(self) -> int:
        """Rows :meth:`rows` may start at a multiple of: where a double-quantisation group of
        ``BLOCK * BLOCK2`` weights begins (8 rows at 2048 columns, 256 at 576)."""
        group = BLOCK * BLOCK2
        return group // math.gcd(self.shape[1], group)

    def rows(self, start: int, stop: int) -> NF4Weight:
        """Rows ``start:stop`` as an NF4Weight over views of the same buffers (no copy);
        ``start`` a multiple of :attr:`row_alignment`."""
        if start % self.row_alignment or not 0 <= start < stop <= self.shape[0]:
            raise ValueError(f"NF4Weight.rows({start}, {stop}) of {tuple(self.shape)}: start must "
                             f"be a multiple of {self.row_alignment} below stop <= {self.shape[0]}")  # fmt: skip
        first, n = start * self.shape[1], (stop - start) * self.shape[1]
        b0, nb = first // BLOCK, -(-n // BLOCK)
        g0, ng = b0 // BLOCK2, -(-nb // BLOCK2)  # whole groups (the last one padded in absmax_q)
        return NF4Weight(
            self.codes[b0 * BLOCK // 2 : (b0 + nb) * BLOCK // 2],
            self.absmax_q[g0 * BLOCK2 : (g0 + ng) * BLOCK2],
            self.absmax_scale[g0 : g0 + ng],
            self.absmax_offset,
            (stop - start, self.shape[1]),
            self.dtype,
        )

    @property
    def column_alignment(self) -> int | None:
        """Columns :meth:`dequantize_columns` may start and stop at multiples of: one block of
        ``BLOCK`` weights, where each row holds whole blocks; None where blocks straddle rows."""
        return BLOCK if self.shape[1] % BLOCK == 0 else None

    def dequantize_columns(self, start: int, stop: int, dtype: torch.dtype | None = None):
        """Dense columns ``start:stop`` (out, stop - start) in ``dtype``, the same values as
        those of :meth:`dequantize`; a transient tile (the fused ops' input-gradient products)."""
        dtype = dtype or self.dtype
        align = self.column_alignment
        if align is None or start % align or stop % align or not 0 <= start < stop <= self.shape[1]:
            raise ValueError(f"NF4Weight.dequantize_columns({start}, {stop}) of {tuple(self.shape)}: "
                             f"needs multiples of {BLOCK} in 0..{self.shape[1]} and whole blocks per row")  # fmt: skip
        return kernels.dequantize_columns(self, start, stop, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.absmax_q, self.absmax_scale,
                                                          self.absmax_offset))  # fmt: skip

    def __repr__(self) -> str:
        return f"NF4Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def _by_row_blocks(weight: NF4Weight, dtype: torch.dtype) -> bool:
    """Whether one dense copy of ``weight`` would exceed :data:`~lorafuse.ops.weights.WALK_ABOVE_BYTES`
    (a vocabulary head): then it is walked in blocks of rows (:func:`~lorafuse.ops.weights.row_blocks`)."""
    return weight.shape.numel() * dtype.itemsize > weights.WALK_ABOVE_BYTES


class _NF4LinearFunction(torch.autograd.Function):
    """``x·Wᵀ + b`` for a frozen NF4 ``W``: saves nothing dense; dequantises again in backward."""

    @staticmethod
    def forward(ctx, x, weight: NF4Weight, bias):
        ctx.weight = weight
        if not _by_row_blocks(weight, x.dtype):
            return F.linear(x, weight.dequantize(x.dtype), bias)
        y = weights.linear_by_row_blocks(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if not _by_row_blocks(ctx.weight, g.dtype):
            return g @ ctx.weight.dequantize(g.dtype), None, None
        dx = weights.input_grad_by_row_blocks(g.reshape(-1, g.shape[-1]), ctx.weight, g.dtype)
        return dx.to(g.dtype).view(*g.shape[:-1], -1), None, None


def register_nf4_buffers(module: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """``buffers`` (as :func:`quantize_nf4` returns them) as ``module.nf4_<key>``. fp32 scale and
    offset are kept as their int32 bits: model.to(bf16) / .half() cast floating buffers only, and
    must not round the quantisation constants."""
    for key, value in buffers.items():
        bits = value.view(torch.int32) if value.is_floating_point() else value
        module.register_buffer(f"nf4_{key}", bits)


class NF4Buffers:
    """Mixin of the modules holding ``nf4_*`` buffers (:func:`register_nf4_buffers`).

    :meth:`nf4_weight` builds their :class:`NF4Weight` once and keeps it while the buffers and
    ``compute_dtype`` stay the same: built per access it cost ~11 µs, a sixth of a one-row
    decoding call. ``.to()`` and the other ``_apply`` conversions drop it.
    """

    def nf4_weight(self, shape) -> NF4Weight:
        b = self._buffers
        sources = (b["nf4_codes"], b["nf4_absmax_q"], b["nf4_absmax_scale"], b["nf4_absmax_offset"])
        kept = self.__dict__.get("_nf4_weight")  # (sources, NF4Weight)
        if (
            kept is None
            or any(k is not s for k, s in zip(kept[0], sources))
            or kept[1].dtype != self.compute_dtype
            or kept[1].shape != shape
        ):
            codes, absmax_q, scale, offset = sources
            weight = NF4Weight(codes, absmax_q, scale.view(torch.float32),
                               offset.view(torch.float32), shape, self.compute_dtype)  # fmt: skip
            kept = self.__dict__["_nf4_weight"] = (sources, weight)
        return kept[1]

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_nf4_weight", None)  # it would keep the old buffers alive
        return super()._apply(fn, recurse)


class Linear4bit(NF4Buffers, nn.Linear):
    """An ``nn.Linear`` whose weight is stored as NF4 buffers; ``.weight`` is an :class:`NF4Weight`.

    Subclassing ``nn.Linear`` keeps PEFT's default LoRA dispatch (and stock
    ``PeftModel.from_pretrained``) working unchanged; ``nn.Linear.__init__`` is skipped so no dense
    weight Parameter ever exists. The buffers follow ``.to(device)`` and appear in ``state_dict``.
    """

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = (
            compute_dtype or linear.weight.dtype
        )  # PEFT reads this for adapter dtype
        register_nf4_buffers(self, quantize_nf4(linear.weight))
        bias = (
            None
            if linear.bias is None
            else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        )
        self.register_parameter("bias", bias)

    @property
    def weight(self) -> NF4Weight:  # type: ignore[override]
        return self.nf4_weight((self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if kernels.decodes(x, weight, self.bias):  # a few rows, no gradient: ops/nf4.py's rule
            return kernels.decode_linear(x, weight, self.bias)
        return _NF4LinearFunction.apply(x, weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


@contextlib.contextmanager
def peft_dora_init():
    """While PEFT creates DoRA adapters (QDoRA): its magnitude init reads each base weight
    through ``peft.tuners.lora.dora.dequantize_module_weight``, which knows bitsandbytes' and
    HQQ's layers but not :class:`Linear4bit` (a TypeError). Inside this block that name
    dequantizes a Linear4bit in its compute dtype, as it does a bitsandbytes layer; restored on
    exit. The forward never needs it: lorafuse's fused DoRA op reads NF4 weights itself."""
    from peft.tuners.lora import dora

    original = dora.dequantize_module_weight

    def dequantize(module):
        if isinstance(module, Linear4bit):
            return module.weight.dequantize(module.compute_dtype)
        return original(module)

    dora.dequantize_module_weight = dequantize
    try:
        yield
    finally:
        dora.dequantize_module_weight = original


def quantize_model_(
    model: nn.Module, compute_dtype: torch.dtype, skip: tuple[nn.Module, ...] = ()
) -> int:
    """Replace every ``nn.Linear`` of ``model`` (except ``skip``, e.g. the lm_head) by a Linear4bit.

    Frees each dense weight as it goes. Returns the number of layers quantised.
    """
    from tqdm.auto import tqdm

    skip_ids = {id(m) for m in skip}
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and id(mod) not in skip_ids]  # fmt: skip
    for name, mod in tqdm(targets, desc="NF4 quantise", unit="layer", disable=len(targets) < 50):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Linear4bit(mod, compute_dtype))
    return len(targets)


def quantized_weights(model: nn.Module) -> list[NF4Weight]:
    """Every NF4 weight of ``model`` once (a tied head shares its embedding's buffers)."""
    found = {}
    for m in model.modules():
        w = getattr(m, "weight", None) if hasattr(m, "nf4_codes") else None
        if isinstance(w, NF4Weight):
            found.setdefault(w.codes.data_ptr(), w)
    return list(found.values())


def memory_report(model: nn.Module) -> dict[str, int]:
    """Parameter + buffer bytes of ``model`` and of the same model held entirely in bf16.

    ``quantized``: the NF4 buffers; ``linear_bf16``: those layers' weights in bf16; ``total``:
    every parameter and buffer as held; ``model_bf16``: every parameter and buffer in bf16 with
    the quantised weights dense.
    """
    quantized = linear = 0
    for w in quantized_weights(model):
        quantized += w.nbytes()
        linear += w.shape.numel() * 2
    tensors = list(model.parameters()) + list(model.buffers())
    # by storage: NF4 experts' zero-stride placeholder parameters hold 2 bytes, not their shape
    total = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )
    dense = sum(t.numel() * 2 for t in tensors if t.is_floating_point())  # NF4 buffers are ints
    return {
        "quantized": quantized,
        "linear_bf16": linear,
        "total": total,
        "model_bf16": dense + linear,
    }
