"""Route PEFT LoRA ``Linear`` layers through :func:`lorafuse.ops.lora_linear.lora_linear`.

Each eligible ``peft.tuners.lora.layer.Linear`` gets an *instance* ``forward`` (the class, the
module names and the state_dict keys are untouched, so PEFT's save/load, merge and adapter
switching keep working). The fused forward re-checks PEFT's state on every call:

* adapters disabled (``with model.disable_adapter():``), merged, no active adapter on this
  module, or ``adapter_names=`` mixed batches -> PEFT's own forward, because that *is* PEFT's
  behaviour there (base layer only, or its mixed-batch path), not a fallback;
* a state the fused op cannot express that appeared after patching (several active adapters, a
  LoRA variant other than DoRA made active, a trainable base weight) -> PEFT's own forward with
  a one-time warning naming the module and the reason.

A DoRA adapter (``use_dora=True``) runs :func:`lorafuse.ops.dora.dora_linear` (fused DoRA:
PEFT's magnitude vector and detached weight norm), a plain one
:func:`lorafuse.ops.lora_linear.lora_linear`; the choice is re-read per call with the rest of
PEFT's state.

Under ``torch.autocast`` the fused op follows autocast as PEFT's three linears do (operands in
the autocast dtype, output too; see :mod:`lorafuse.ops.autocast`).

Eligible at patch time: base layer a plain ``nn.Linear`` or any layer whose ``.weight`` is a
quantized weight object (:mod:`lorafuse.ops.weights`), ``fan_in_fan_out=False``, and exactly one
active adapter that is vanilla LoRA or DoRA (no other ``lora_variant``, no ``lora_bias``).
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lorafuse.ops.dora import dora_linear
from lorafuse.ops.lora_linear import lora_linear
from lorafuse.ops.weights import is_quantized

_PREV = "_lorafuse_prev_forward"  # instance attr: the instance forward we replaced (or None)
_BACKEND = "_lorafuse_backend"
_WARNED = "_lorafuse_warned"


# --------------------------------------------------------------------------------------------
# Instance-forward installation, shared with the per-architecture fast paths.


def install_forward(module: nn.Module, fn: Callable, backend: str | None) -> None:
    """Bind ``fn(self, *args, **kwargs)`` as ``module.forward``; idempotent, revertible.

    The bound forward keeps the class forward's name, docstring and signature: ``Trainer``
    (``remove_unused_columns``) and ``generate`` read the model's inputs from that signature, and
    a bare ``(*args, **kwargs)`` made ``Trainer`` drop every dataset column.
    """
    if not is_installed(module):
        setattr(module, _PREV, module.__dict__.get("forward"))

    def forward(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    functools.update_wrapper(forward, type(module).forward)
    forward._lorafuse_fn = fn
    module.forward = types.MethodType(forward, module)
    setattr(module, _BACKEND, backend)


def installed_backend(module: nn.Module) -> str | None:
    """The backend :func:`install_forward` was given for ``module`` (None: none installed)."""
    return module.__dict__.get(_BACKEND)


def is_installed(module: nn.Module) -> bool:
    return _PREV in module.__dict__


def restore_forward(module: nn.Module) -> bool:
    """Undo :func:`install_forward`; returns whether anything was restored."""
    if not is_installed(module):
        return False
    prev = module.__dict__.pop(_PREV)
    module.__dict__.pop("forward", None)
    module.__dict__.pop(_BACKEND, None)
    module.__dict__.pop(_WARNED, None)
    if prev is not None:
        module.forward = prev
    return True


def original_forward(module: nn.Module, *args, **kwargs):
    """Call the forward that was in place before lorafuse patched ``module``."""
    prev = module.__dict__.get(_PREV)
    if prev is not None:
        return prev(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def warn_once(module: nn.Module, message: str) -> None:
    """One warning per module and message: a fast path that did not run is never silent."""
    seen = module.__dict__.setdefault(_WARNED, set())
    if message not in seen:
        seen.add(message)
        warnings.warn(f"lorafuse: {message}", RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------
# Eligibility.


def _lora_classes():
    from peft.tuners.lora import layer as lora_layer

    return lora_layer


def is_lora_layer(module: nn.Module) -> bool:
    return isinstance(module, _lora_classes().LoraLayer)


def static_reason(module: nn.Module) -> str | None:
    """Why this LoRA module can never take the fused path (None: it can)."""
    lora_layer = _lora_classes()
    if type(module) is not lora_layer.Linear:
        kind = type(module).__name__
        if isinstance(module, lora_layer.Embedding):
            return "Embedding LoRA (no fused path; PEFT's forward is already a lookup)"
        if isinstance(module, lora_layer._ConvNd):
            return f"{kind} LoRA (convolution; no fused path)"
        return f"unsupported LoRA layer type {type(module).__module__}.{kind}"
    if module.fan_in_fan_out:
        return "fan_in_fan_out=True (Conv1D / GPT-2 style base weight)"
    base = module.get_base_layer()
    if getattr(base, "_hf_hook", None) is not None:
        return "base layer has an accelerate hook (device_map offload); PEFT path keeps it working"
    weight = getattr(base, "weight", None)
    if weight is not None and is_quantized(weight):
        if not hasattr(weight, "dequantize"):
            return f"base weight {type(weight).__name__} has no .dequantize(dtype)"
        return None
    if type(base) is not nn.Linear:
        return f"unsupported base layer type {type(base).__module__}.{type(base).__name__}"
    return None


def adapter_reason(module: nn.Module) -> tuple[str | None, str | None]:
    """``(adapter, None)`` when the current adapter state fits the fused op, else ``(None, why)``.

    ``why`` is None when PEFT itself would use only the base layer (no active adapter here).
    """
    active = [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return None, None
    if len(active) > 1:
        return None, f"several active adapters ({', '.join(active)})"
    name = active[0]
    variant = module.lora_variant.get(name)
    if variant is not None and not is_dora(module, name):
        return None, f"{type(variant).__name__} adapter {name!r} (LoRA variant; no fused path)"
    if module.lora_bias.get(name, False):
        return None, f"lora_bias=True on adapter {name!r}"
    drop = module.lora_dropout[name]
    if not isinstance(drop, (nn.Dropout, nn.Identity)):
        return None, f"custom lora_dropout module {type(drop).__name__}"
    weight = module.get_base_layer().weight
    if isinstance(weight, torch.Tensor) and weight.requires_grad:
        return None, "base weight is trainable (the fused op gives frozen weights no gradient)"
    return name, None


def is_dora(module: nn.Module, adapter: str) -> bool:
    """Whether ``adapter`` on ``module`` is PEFT's DoRA on a Linear (its magnitude vector exists)."""
    from peft.tuners.lora.variants import DoraLinearVariant

    variant = module.lora_variant.get(adapter)
    return (
        type(variant) is DoraLinearVariant
        and module.use_dora.get(adapter, False)
        and adapter in module.lora_magnitude_vector
    )


def runs_dora(module: nn.Module) -> bool:
    """Whether ``module``'s current adapter state runs the fused DoRA op."""
    adapter, _ = adapter_reason(module)
    return adapter is not None and is_dora(module, adapter)


@dataclass
class LoRAState:
    """What the fused op needs from one LoRA Linear right now (see :func:`fused_state`)."""

    weight: object  # (k, d) Tensor or quantized weight object
    bias: torch.Tensor | None  # (k,)
    lora_A: torch.Tensor  # (r, d)
    lora_B: torch.Tensor  # (k, r)
    scaling: float
    dropout_p: float
    training: bool
    magnitude: torch.Tensor | None = None  # (k,) DoRA's magnitude vector; None: plain LoRA


def fused_state(module: nn.Module, x: torch.Tensor) -> LoRAState | None:
    """The fused-op inputs for ``module`` on input ``x``, or None when PEFT's forward must run.

    Warns once (per module and reason) when the state is one the fused op cannot express.
    """
    if module.disable_adapters or module.merged:
        return None  # PEFT: base layer only (it unmerges first when disabled)
    adapter, why = adapter_reason(module)
    if adapter is None:
        if why is not None:
            warn_once(
                module, f"{getattr(module, '_lorafuse_name', '?')}: {why}; running PEFT's forward"
            )
        return None
    lora_A = module.lora_A[adapter].weight
    if x.dtype != lora_A.dtype and not getattr(module, "cast_input_dtype_enabled", True):
        return None  # PEFT's own (erroring or custom) behaviour for disabled input casting
    base = module.get_base_layer()
    drop = module.lora_dropout[adapter]
    p = float(drop.p) if isinstance(drop, nn.Dropout) else 0.0
    return LoRAState(
        weight=base.weight,
        bias=base.bias,
        lora_A=lora_A,
        lora_B=module.lora_B[adapter].weight,
        scaling=float(module.scaling[adapter]),
        dropout_p=p,
        training=drop.training,
        magnitude=(
            module.lora_magnitude_vector[adapter].weight if is_dora(module, adapter) else None
        ),
    )


# --------------------------------------------------------------------------------------------
# The patched forward.


def _fused_lora_forward(self, x, *args, **kwargs):
    if args or kwargs:  # adapter_names= mixed batches, variant kwargs: PEFT's own paths
        return original_forward(self, x, *args, **kwargs)
    st = fused_state(self, x)
    if st is None:
        return original_forward(self, x)
    args = (x, st.weight, st.bias, st.lora_A, st.lora_B)
    if st.magnitude is not None:
        args += (st.magnitude,)
    op = lora_linear if st.magnitude is None else dora_linear
    return op(*args, st.scaling, st.dropout_p, st.training, self.__dict__.get(_BACKEND))


def patch_lora_linear(module: nn.Module, backend: str | None) -> None:
    install_forward(module, _fused_lora_forward, backend)


def is_fused_lora(module: nn.Module) -> bool:
    """Whether ``module`` is a LoRA Linear carrying the lorafuse fused forward."""
    fwd = module.__dict__.get("forward")
    fn = getattr(getattr(fwd, "__func__", None), "_lorafuse_fn", None)
    return is_installed(module) and fn is _fused_lora_forward
