"""Dtype names as users write them (flags, YAML, JSON) -> torch dtypes: the one table."""

from __future__ import annotations

import torch

NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16``; None and ``"auto"`` -> None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        return None
    if name not in NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(NAMES)} or auto")
    return NAMES[name]
