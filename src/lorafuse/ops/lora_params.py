"""One LoRA projection as the fused ops take it: a base linear ``weight`` / ``bias`` and an optional
adapter (:class:`LoRAParams`), and the checks every op runs on one (:func:`check_params`).

Shapes: x (N, d), weight (k, d) dense or quantized (see :mod:`lorafuse.ops.weights`), bias (k,),
lora_A (r, d), lora_B (k, r).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lorafuse.ops.weights import is_quantized


class LoRAParams(NamedTuple):
    """A base linear ``weight``/``bias`` plus an optional LoRA adapter.

    ``lora_A``/``lora_B`` both None means "no LoRA on this projection": a plain frozen linear.
    ``weight`` may be a quantized weight object (``.shape`` and ``.dequantize(dtype)``).
    ``dropout_p`` is the adapter's ``lora_dropout`` (applied only when the op runs with
    ``training=True``).
    """

    weight: Any
    bias: torch.Tensor | None = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    scaling: float = 1.0
    dropout_p: float = 0.0

    @property
    def has_lora(self) -> bool:
        return self.lora_A is not None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


def check_params(p: LoRAParams, d: int, dtype: torch.dtype, name: str) -> None:
    """Validate one projection that reads inputs of width ``d`` and dtype ``dtype``."""
    if not isinstance(p, LoRAParams):
        raise TypeError(f"{name}: expected LoRAParams, got {type(p).__name__}")
    w = p.weight
    if len(w.shape) != 2 or w.shape[1] != d:
        raise ValueError(
            f"{name}.weight must be (out, {d}) for input (..., {d}), got {tuple(w.shape)}"
        )
    if not is_quantized(w):
        if w.dtype != dtype:
            raise ValueError(f"{name}.weight dtype {w.dtype} does not match input dtype {dtype}")
        if w.requires_grad and torch.is_grad_enabled():
            # The fused kernels compute no base-weight gradient; refusing beats freezing silently.
            raise ValueError(
                f"{name}.weight requires grad, but the fused LoRA ops treat base weights as frozen; "
                "freeze it (weight.requires_grad_(False)) or run the module unfused"
            )
    k = w.shape[0]
    if p.bias is not None and tuple(p.bias.shape) != (k,):
        raise ValueError(f"{name}.bias must be ({k},), got {tuple(p.bias.shape)}")
    if (p.lora_A is None) != (p.lora_B is None):
        raise ValueError(f"{name}: lora_A and lora_B must both be given or both be None")
    if p.lora_A is None:
        return
    A, B = p.lora_A, p.lora_B
    if A.dim() != 2 or A.shape[1] != d:
        raise ValueError(f"{name}.lora_A must be (r, {d}), got {tuple(A.shape)}")
    if B.dim() != 2 or tuple(B.shape) != (k, A.shape[0]):
        raise ValueError(f"{name}.lora_B must be ({k}, {A.shape[0]}), got {tuple(B.shape)}")
    if A.dtype != B.dtype:
        raise ValueError(f"{name}: lora_A ({A.dtype}) and lora_B ({B.dtype}) dtypes differ")
    if not 0.0 <= p.dropout_p < 1.0:
        raise ValueError(f"{name}.dropout_p must be in [0, 1), got {p.dropout_p}")
