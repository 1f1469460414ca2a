"""Example boundaries for the hybrids' stateful token mixers: per-instance, revertible patching.

Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), short convolutions (LFM2, LFM2-MoE) and Mamba2
(Granite 4) carry state along the sequence; transformers' CPU paths run it straight through the
examples of a packed row. :func:`install` binds, on every matching *instance*:

* the decoder model (``Qwen3_5TextModel``, ``Lfm2Model``, ...): :func:`decoder_forward` finds the
  example boundaries once per forward (:func:`lorafuse.patching.segments.find`: position-id
  restarts, padding) and hands them to every layer under the keyword
  :data:`~lorafuse.patching.mixer_forwards.SEGMENTS`. Where a model's mask builder is not given the
  position ids (Granite 4, gpt-oss: ``mask_positions``), it also builds the packed rows' attention
  masks with them (transformers' own mask functions, through the model's mask-mapping input);
* every mixer: the forwards of :mod:`lorafuse.patching.mixer_forwards` (lorafuse's ops, state
  restarted at every boundary, decode states in transformers' cache).

:func:`unisolated` lists what still carries state across examples (a stateful mixer lorafuse does
not patch): :func:`lorafuse.models.capabilities.packing_supported` turns packing off for it and
says why. :func:`uninstall` (or ``unpatch_peft_model``) restores the stock forwards.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lorafuse.patching import segments
from lorafuse.patching.mixer_forwards import (
    SEGMENTS,
    gated_delta_net_forward,
    mamba2_forward,
    short_conv_forward,
)
from lorafuse.patching.peft_lora import (
    install_forward,
    original_forward,
    restore_forward,
)

ACTIVATIONS = (None, "silu")  # what lorafuse.ops.causal_conv1d applies


@dataclass(frozen=True)
class MixerSpec:
    """One family: its modeling module, decoder model class and stateful mixer classes."""

    module: str
    model: str  # the decoder model class: it finds the boundaries once per forward
    mixers: tuple[tuple[str, Callable], ...] = ()  # (class name, lorafuse forward)
    mask_positions: bool = False  # its mask builder is not given position ids: build packed masks

    def classes(self) -> tuple[type | None, dict[type, Callable]]:
        mod = sys.modules.get(self.module)  # a model holding these classes has imported it
        if mod is None:
            return None, {}
        found = {getattr(mod, n, None): fn for n, fn in self.mixers}
        return getattr(mod, self.model, None), {c: fn for c, fn in found.items() if c is not None}


_M = "transformers.models.{0}.modeling_{0}"
SPECS = (
    MixerSpec(_M.format("qwen3_5"), "Qwen3_5TextModel",
              (("Qwen3_5GatedDeltaNet", gated_delta_net_forward),)),
    MixerSpec(_M.format("qwen3_5_moe"), "Qwen3_5MoeTextModel",
              (("Qwen3_5MoeGatedDeltaNet", gated_delta_net_forward),)),
    MixerSpec(_M.format("qwen3_next"), "Qwen3NextModel",
              (("Qwen3NextGatedDeltaNet", gated_delta_net_forward),)),
    MixerSpec(_M.format("lfm2"), "Lfm2Model", (("Lfm2ShortConv", short_conv_forward),)),
    MixerSpec(_M.format("lfm2_moe"), "Lfm2MoeModel", (("Lfm2MoeShortConv", short_conv_forward),)),
    MixerSpec(_M.format("granitemoehybrid"), "GraniteMoeHybridModel",
              (("GraniteMoeHybridMambaLayer", mamba2_forward),), mask_positions=True),
    MixerSpec(_M.format("gpt_oss"), "GptOssModel", mask_positions=True),
)  # fmt: skip
_MIXER_FORWARDS = (gated_delta_net_forward, short_conv_forward, mamba2_forward)
_STATE_WORDS = ("recurrent_state", "conv_state", "ssm_state", "causal_conv1d", "selective_scan")


def _spec_of(model: nn.Module) -> tuple[MixerSpec, type, dict] | None:
    """The spec whose decoder model class is inside ``model`` (None: no family of ours)."""
    types = {type(m) for m in model.modules()}
    for spec in SPECS:
        decoder, mixers = spec.classes()
        if decoder is not None and decoder in types:
            return spec, decoder, mixers
    return None


def mixer_blocker(module: nn.Module) -> str | None:
    """Why lorafuse's forward cannot run ``module`` (a known mixer class), or None."""
    act = getattr(module, "activation", None)
    if hasattr(module, "conv1d") and act not in ACTIVATIONS:
        return f"conv activation {act!r} is not one of {ACTIVATIONS}"
    return None


def install(model: nn.Module) -> dict[str, int]:
    """Bind the boundary-aware forwards on ``model``'s decoder model and mixers (idempotent);
    returns ``{fast path name: modules}`` for the report."""
    found = _spec_of(model)
    if found is None:
        return {}
    spec, decoder, mixers = found
    out: dict[str, int] = {}
    for module in model.modules():
        fn = mixers.get(type(module))
        if fn is not None and mixer_blocker(module) is None:
            install_forward(module, fn, None)
            name = f"{type(module).__name__}[boundaries: {_ops_of(fn)}]"
            out[name] = out.get(name, 0) + 1
        elif type(module) is decoder:
            module._lorafuse_mixers = spec
            install_forward(module, decoder_forward, None)
            parts = (("example boundaries", spec.mixers), ("packed masks", spec.mask_positions))
            what = " + ".join(w for w, on in parts if on)
            name = f"{decoder.__name__}[{what} from position ids]"
            out[name] = out.get(name, 0) + 1
    return out


def _ops_of(fn: Callable) -> str:
    return {
        gated_delta_net_forward: "causal_conv1d + gated_delta_rule",
        short_conv_forward: "causal_conv1d",
        mamba2_forward: "causal_conv1d + mamba2_scan",
    }[fn]


def _patched_with(module: nn.Module) -> Callable | None:
    fwd = module.__dict__.get("forward")
    return getattr(getattr(fwd, "__func__", None), "_lorafuse_fn", None)


def uninstall(model: nn.Module) -> int:
    """Restore every forward :func:`install` bound; returns how many."""
    ours = {decoder_forward, *_MIXER_FORWARDS}
    count = 0
    for module in model.modules():
        if _patched_with(module) in ours:
            count += restore_forward(module)
            module.__dict__.pop("_lorafuse_mixers", None)
    return count


def is_stateful(module: nn.Module) -> bool:
    """Whether ``module`` looks like a token mixer carrying state along the sequence: a depthwise
    ``nn.Conv1d`` child, or a forward that reads a recurrent / conv / SSM state."""
    if any(isinstance(c, nn.Conv1d) and c.groups == c.in_channels > 1 for c in module.children()):
        return True
    return _reads_state(type(module))


@functools.cache
def _reads_state(cls: type) -> bool:
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return any(w in src for w in _STATE_WORDS)


def unisolated(model: nn.Module) -> list[str]:
    """What lets state cross packed examples in ``model``: one line per stateful mixer class
    lorafuse does not run with boundaries (empty: every one does)."""
    by_class: dict[type, list[str]] = {}
    hooked = any(_patched_with(m) is decoder_forward for m in model.modules())
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.ModuleDict) or not is_stateful(module):
            continue
        if _patched_with(module) not in _MIXER_FORWARDS or not hooked:
            by_class.setdefault(type(module), []).append(name)
    return [
        f"{cls.__name__} ({len(names)} module(s), e.g. {names[0]}) carries state along the "
        f"sequence and lorafuse gives it no example boundaries"
        + (f": {why}" if (why := mixer_blocker(model.get_submodule(names[0]))) else "")
        for cls, names in by_class.items()
    ]


def builds_packed_masks(model: nn.Module) -> bool:
    """Whether :func:`decoder_forward` builds ``model``'s packed attention masks itself."""
    return any(
        _patched_with(m) is decoder_forward and m._lorafuse_mixers.mask_positions
        for m in model.modules()
    )


# --------------------------------------------------------------------------------------------
# The decoder model's forward.

_INPUTS = ("input_ids", "attention_mask", "position_ids")


def decoder_forward(self, *args, **kwargs):
    """``<Family>Model.forward``: boundaries found once, handed to every mixer; packed masks built
    with the position ids where the model's own mask builder is not given them."""
    spec: MixerSpec = self._lorafuse_mixers
    given = dict(zip(_INPUTS, args)) | {k: kwargs[k] for k in _INPUTS if k in kwargs}
    ref = given.get("input_ids")
    ref = kwargs.get("inputs_embeds") if ref is None else ref
    if ref is None:
        return original_forward(self, *args, **kwargs)
    b, t = ref.shape[:2]
    mask, pos = given.get("attention_mask"), given.get("position_ids")
    seg = segments.find(pos, None if isinstance(mask, dict) else mask, b, t)
    if spec.mixers:
        kwargs[SEGMENTS] = seg
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if spec.mask_positions and seg is not None and mask is None and cache is None:
        masks = _packed_masks(self, ref, pos, b, t)
        if len(args) > 1:
            args = (args[0], masks, *args[2:])
        else:
            kwargs["attention_mask"] = masks
    return original_forward(self, *args, **kwargs)


def _packed_masks(model, ref: torch.Tensor, positions, batch: int, length: int) -> dict:
    """transformers' own mask of every layer type for packed rows, given the position ids."""
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING as BUILD

    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    like = torch.empty(batch, length, 0, dtype=dtype, device=ref.device)  # shape / dtype / device
    positions = segments.text_positions(positions).expand(batch, -1)
    return {
        kind: BUILD[kind](
            config=model.config,
            inputs_embeds=like,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )  # fmt: skip
        for kind in set(getattr(model.config, "layer_types", None) or ["full_attention"])
    }
