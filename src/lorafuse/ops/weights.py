"""Base weights as the fused ops see them: a dense Tensor, or a quantized weight object.

A quantized base weight (e.g. NF4, see :mod:`lorafuse.models.nf4`) is any object with
``.shape`` (out, in) and ``.dequantize(dtype) -> Tensor``. The fused ops call :func:`materialize`
in forward *and* backward, so the dense copy is transient and never saved for backward.
"""

from __future__ import annotations

import torch


def is_quantized(weight) -> bool:
    return not isinstance(weight, torch.Tensor)


def materialize(weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``(out, in)`` weight in ``dtype``: the tensor itself, or a transient dequantized copy."""
    if isinstance(weight, torch.Tensor):
        return weight
    return weight.dequantize(dtype)
