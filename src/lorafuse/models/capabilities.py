"""What a loaded model can do that the training engine needs to know before it starts."""

from __future__ import annotations

import inspect
import sys

# Attention implementations whose transformers mask builder turns packed rows' position-id resets
# into per-example block-diagonal masks (masking_utils.create_causal_mask).
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flex_attention")


def packing_supported(model) -> tuple[bool, str]:
    """Whether this model isolates packed examples given only position ids (see data.packing)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        return False, f"attention implementation {impl!r} is not one of {PACKING_ATTENTION}"
    module = sys.modules.get(type(model).__module__)
    try:
        source = inspect.getsource(module) if module else ""
    except (OSError, TypeError):
        source = ""
    if "create_causal_mask" not in source:
        return (
            False,
            f"{type(model).__name__} does not build its mask with masking_utils.create_causal_mask",
        )
    return True, impl
