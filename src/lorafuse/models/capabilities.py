"""What a loaded model can do that the training engine needs to know before it starts."""

from __future__ import annotations

import ast
import inspect
import textwrap

from lorafuse.patching import mixers

# Attention implementations whose transformers mask builder turns packed rows' position-id resets
# into per-example block-diagonal masks (masking_utils.create_causal_mask).
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flex_attention")
MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


def _forward_source(cls: type) -> str:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return ""


def mask_builder(model) -> type | None:
    """The class inside ``model`` whose forward builds the attention masks with transformers'
    ``masking_utils`` builders (the decoder model), or None."""
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        if any(name in _forward_source(cls) for name in MASK_BUILDERS):
            return cls
    return None


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def gives_positions(cls: type) -> bool:
    """Whether ``cls.forward`` hands the position ids to its mask builders (directly, through a
    ``mask_kwargs = {...}`` dict, or through an alias such as ``mask_function = ...``): what lets
    transformers find the packed examples."""
    tree = ast.parse(_forward_source(cls))
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    targets = [(t.id, a.value) for a in assigns for t in a.targets if isinstance(t, ast.Name)]
    dicts = {name: value for name, value in targets if isinstance(value, ast.Dict)}
    builders = set(MASK_BUILDERS) | {n for n, v in targets if _names(v) & set(MASK_BUILDERS)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or getattr(node.func, "id", None) not in builders:
            continue
        if len(node.args) >= 5 or any(k.arg == "position_ids" for k in node.keywords):
            return True
        for k in node.keywords:
            d = dicts.get(getattr(k.value, "id", None)) if k.arg is None else None
            if d is not None and "position_ids" in {getattr(key, "value", None) for key in d.keys}:
                return True
    return False


def packing_supported(model) -> tuple[bool, str]:
    """Whether this model isolates packed examples given only position ids (see data.packing):
    attention masks built from them (by transformers' mask builder, or by lorafuse where the model
    does not hand them over) and every stateful token mixer run with example boundaries
    (:mod:`lorafuse.patching.mixers`). ``(False, why)`` otherwise."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        return False, f"attention implementation {impl!r} is not one of {PACKING_ATTENTION}"
    builder = mask_builder(model)
    if builder is None:
        return (
            False,
            f"{type(model).__name__} does not build its mask with masking_utils.create_causal_mask",
        )
    if not gives_positions(builder) and not mixers.builds_packed_masks(model):
        return False, (
            f"{builder.__name__} builds its attention masks without the position ids, so packed "
            "examples would attend to each other"
        )
    leaks = mixers.unisolated(model)
    if leaks:
        return False, "; ".join(leaks)
    return True, impl
