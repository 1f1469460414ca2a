"""Gradient (activation) checkpointing per decoder layer, with optional CPU offload on CUDA.

``True``: each decoder layer keeps only its input for backward and recomputes its inside
(transformers' non-reentrant ``torch.utils.checkpoint``). ``"offload"``: the same, and the kept
layer inputs go to pinned host memory (``torch.autograd.graph.save_on_cpu``) -- on CUDA this
frees ``layers x tokens x hidden`` of device memory for a device->host copy in forward and a
host->device copy in backward. On a CPU device there is nothing to offload to, so it acts as
``True`` and says so. Recomputation is exact: the loss and gradients do not change.

``lorafuse train`` leaves the choice to :func:`auto_choice` unless told: recomputation costs a
third more forward work on every step, worth it only where the activations would not fit.
"""

from __future__ import annotations

import weakref

import torch

from lorafuse.models.source import say

MODES = (True, False, "offload", "unsloth")  # "unsloth": accepted alias of "offload"
# transformers forgets the mode once checkpointing is off (for_inference); for_training turns it
# back on as configured, so :func:`enable` records it here, per transformers model.
_configured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_model(model):
    """The transformers PreTrainedModel under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def normalise_mode(mode, device: torch.device) -> bool | str:
    """``True`` / ``False`` / ``"offload"`` for ``device``; prints what offload means there."""
    if mode not in MODES and mode is not None:
        raise ValueError(
            f"use_gradient_checkpointing must be True, False or 'offload', got {mode!r}"
        )
    if mode in ("offload", "unsloth"):
        if device.type != "cuda":
            say(f"gradient checkpointing 'offload' on {device.type}: activations already live in host "
                "memory, so it works as use_gradient_checkpointing=True")  # fmt: skip
            return True
        return "offload"
    return bool(mode)


def enable(model, mode: bool | str) -> None:
    """Turn on per-layer checkpointing (``mode`` from :func:`normalise_mode`); ``False`` turns it off."""
    hf = hf_model(model)
    if not mode:
        disable(model)
        _configured.pop(hf, None)
        return
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(hf).__name__} does not support gradient checkpointing; pass "
                         "use_gradient_checkpointing=False")  # fmt: skip
    kwargs = {"use_reentrant": False}  # non-reentrant: works with frozen inputs and kwargs
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs, offload=mode == "offload"
        )
    elif mode == "offload":
        raise RuntimeError("this transformers version has no activation offload; use True")
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Only the adapters need grads, but the checkpointed layers must see an input that requires
    # grad for backward to reach them from a frozen embedding.
    hf.enable_input_require_grads()
    hf.config.use_cache = False  # a KV cache is useless in training and conflicts with recompute
    _configured[hf] = mode


def mode_of(model) -> bool | str:
    """The mode :func:`enable` last set on ``model`` (False: none), whether or not
    :func:`disable` has turned it off since."""
    return _configured.get(hf_model(model), False)


def disable(model) -> None:
    hf = hf_model(model)
    if hasattr(hf, "activation_checkpointing_disable"):  # transformers >= 5.x naming
        if hf.is_activation_checkpointing:
            hf.activation_checkpointing_disable()
    elif hf.is_gradient_checkpointing:
        hf.gradient_checkpointing_disable()


def measure_activation_memory(model, input_ids: torch.Tensor) -> int:
    """Bytes saved for backward by one training forward of ``model`` on ``input_ids`` (B, T).

    Exclude the model's own parameters and buffers (e.g. frozen weights autograd references):
    they are resident either way.
    """
    model.train()  # checkpointing (like dropout) is active in training mode only
    resident = {p.untyped_storage().data_ptr() for p in model.parameters()}
    resident |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in resident:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return sum(seen.values())
