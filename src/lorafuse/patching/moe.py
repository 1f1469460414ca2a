"""Mixture-of-experts blocks on the fused expert op (:func:`lorafuse.ops.moe_lora.moe_lora`).

transformers 5 stores routed experts as fused 3-D parameters (``experts.gate_up_proj`` (E, 2I, H)
and ``experts.down_proj`` (E, H, I); gpt-oss transposed, interleaved, with biases); PEFT adapts
them with ``ParamWrapper`` (``LoraConfig(target_parameters=...)``), one wrapper per parameter,
nested around the experts module. Stock PEFT then materialises ``W + s·B·A`` for every expert
on every forward and runs transformers' Python loop over the experts.

* :func:`apply` (``patch_peft_model``): the outermost wrapper of each experts module gets an
  instance forward that calls the fused op with every wrapper's adapter; an experts module
  without LoRA gets the fused op without adapters (the stock loop otherwise). Each forward
  re-reads PEFT's state: adapters disabled or merged, several active adapters, a trainable base
  -> the wrapper's own forward (the last two with a one-time warning).
* :func:`install_frozen` (``FastLanguageModel.from_pretrained``): experts modules without PEFT run
  the fused op too (decoding's per-token step included).
* Routers (``*Router`` modules, 2-D ``weight`` (E, H)) keep their own forward: their LoRA, where
  targeted, is PEFT's parametrisation of a small matrix; the router's top-k and the load
  balancing loss stay the model's own, the op receives the chosen experts and their weights.

Which experts the op can express (:func:`activation_of`): a gate/up pair with SwiGLU (``act_fn``
silu, halves or interleaved) or gpt-oss's clamped SwiGLU; anything else stays stock, reported.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn.utils import parametrize

from lorafuse.errors import LorafuseError
from lorafuse.ops.moe_lora import Activation, ExpertStack, moe_lora, peft_factors
from lorafuse.ops.weights import is_quantized
from lorafuse.patching.peft_lora import install_forward, original_forward, warn_once
from lorafuse.patching.report import PatchReport

GATE_UP, DOWN = "gate_up_proj", "down_proj"
FAST_PATH = "moe.experts[moe_lora]"


# --------------------------------------------------------------------------------------------
# What an experts module is and how it computes.


def is_experts(module: nn.Module) -> bool:
    """A routed-experts stack: ``num_experts`` and a 3-D ``gate_up_proj`` / ``down_proj``
    (Parameter, or an NF4 expert stack) with that many experts."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or isinstance(module, _param_wrapper()):
        return False
    w = expert_weight(module, DOWN)
    return w is not None and len(w.shape) == 3 and w.shape[0] == n


def is_router(module: nn.Module) -> bool:
    """A top-k router module (not an ``nn.Linear``) holding a 2-D ``weight`` (E, H)."""
    w = getattr(module, "weight", None)
    return type(module).__name__.endswith("Router") and isinstance(w, torch.Tensor) and w.dim() == 2


def expert_weight(module: nn.Module, name: str):
    """``module``'s base stack ``name``: the NF4 expert stack where quantised, else the parameter
    as stored (never PEFT's parametrised ``W + s·B·A``)."""
    quantized = getattr(module, "lorafuse_nf4_experts", {}).get(name)
    if quantized is not None:
        return quantized
    if parametrize.is_parametrized(module, name):
        return module.parametrizations[name].original
    return module._parameters.get(name)


def activation_of(experts: nn.Module) -> tuple[Activation | None, str | None]:
    """``(activation, None)`` when the fused op computes this experts module, else
    ``(None, why)``."""
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(experts, "has_gate", False) or expert_weight(experts, GATE_UP) is None:
        return None, "experts without a gate_up_proj pair (no fused path)"
    if getattr(experts, "has_post_expert_norm", False):
        return None, "experts with a post-expert norm (no fused path)"
    if getattr(experts, "_is_expert_parallel", False):
        return None, "expert parallelism (sentinel expert ids)"
    interleaved = not getattr(experts, "is_concatenated", True)
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is _default_apply_gate:
        act = getattr(experts, "act_fn", None)
        if act is torch.nn.functional.silu or type(act).__name__ in ("SiLU", "SiLUActivation"):
            return Activation("swiglu", interleaved), None
        return None, f"experts activation {type(act).__name__} (the fused op runs SwiGLU)"
    if type(experts).__name__ == "GptOssExperts":  # clamped SwiGLU with alpha and limit
        return Activation("clamped_swiglu", interleaved, float(experts.alpha),
                          float(experts.limit)), None  # fmt: skip
    return None, f"{type(experts).__name__}._apply_gate (no fused equivalent)"


def _param_wrapper():
    from peft.tuners.lora.layer import ParamWrapper

    return ParamWrapper


def wrapper_chain(module: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """``(experts module, {parameter name: its ParamWrapper})`` below an outermost wrapper."""
    wrappers = {}
    while isinstance(module, _param_wrapper()):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return module, wrappers


# --------------------------------------------------------------------------------------------
# The forwards.


def _call_args(args, kwargs):
    names = (("hidden_states",), ("top_k_index", "router_indices"), ("top_k_weights", "routing_weights"))  # fmt: skip
    out = list(args)
    for alts in names[len(args) :]:
        out.append(next(kwargs[n] for n in alts if n in kwargs))
    return out


def _stack(experts, name: str, wrapper, adapter: str | None) -> ExpertStack:
    bias = getattr(experts, f"{name}_bias", None) if getattr(experts, "has_bias", False) else None
    weight = expert_weight(experts, name)
    transposed = bool(getattr(experts, "is_transposed", False))
    if wrapper is None or adapter is None:
        return ExpertStack(weight, bias, None, None, 1.0, transposed)
    A, B = peft_factors(wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight,
                        weight.shape[0])  # fmt: skip
    return ExpertStack(weight, bias, A, B, float(wrapper.scaling[adapter]), transposed)


def _adapter(wrappers: dict) -> tuple[str | None, str | None]:
    """``(adapter, None)`` for the one active adapter on every wrapper; ``(None, why)``."""
    for w in wrappers.values():
        if w.disable_adapters or w.merged:
            return None, ""  # PEFT's own state: base only / merged weights
    names = {a for w in wrappers.values() for a in w.active_adapters if a in w.lora_A}
    if len(names) > 1:
        return None, f"several active adapters ({', '.join(sorted(names))})"
    return (next(iter(names)), None) if names else (None, "")


def _fused_lora_forward(self, *args, **kwargs):
    experts, wrappers = wrapper_chain(self)
    adapter, why = _adapter(wrappers)
    trainable = [n for n in (GATE_UP, DOWN) if getattr(expert_weight(experts, n), "requires_grad", False)]  # fmt: skip
    if adapter is None or trainable:
        if why or trainable:
            why = why or f"trainable base {', '.join(trainable)}"
            warn_once(
                self, f"{getattr(self, '_lorafuse_name', '?')}: {why}; running PEFT's forward"
            )
        return original_forward(self, *args, **kwargs)
    x, idx, w = _call_args(args, kwargs)
    act, _ = activation_of(experts)
    gu = _stack(experts, GATE_UP, wrappers.get(GATE_UP), adapter)
    down = _stack(experts, DOWN, wrappers.get(DOWN), adapter)
    return moe_lora(x, idx, w, gu, down, act, self.__dict__.get("_lorafuse_backend"))


def _frozen_forward(self, *args, **kwargs):
    if any(parametrize.is_parametrized(self, n) for n in (GATE_UP, DOWN)):
        if getattr(self, "lorafuse_nf4_experts", None):  # PEFT's parametrisation reads placeholders
            raise LorafuseError(
                "NF4 expert weights run only through lorafuse's fused expert op; PEFT's own "
                "ParamWrapper forward cannot read them (patch the model: patch_peft_model)"
            )
        return original_forward(self, *args, **kwargs)  # unpatched PEFT: its W + s·B·A
    x, idx, w = _call_args(args, kwargs)
    act, _ = activation_of(self)
    gu, down = _stack(self, GATE_UP, None, None), _stack(self, DOWN, None, None)
    if any(getattr(p.weight, "requires_grad", False) for p in (gu, down)):
        if torch.is_grad_enabled():
            return original_forward(self, *args, **kwargs)  # full fine-tuning: autograd's own path
        # No gradient asked: a loaded model decoding (chat, infer, serve, eval), whose
        # parameters still require grad; the weights are constants to the op here.
        gu, down = (p._replace(weight=p.weight.detach()) for p in (gu, down))
    return moe_lora(x, idx, w, gu, down, act, self.__dict__.get("_lorafuse_backend"))


def bind_quantized(module: nn.Module) -> None:
    """The fused op as the permanent forward of an experts module whose stacks are NF4 (its
    parameters are placeholders: transformers' loop would read zeros); ``unpatch_peft_model``
    keeps it."""
    module.forward = types.MethodType(_frozen_forward, module)


def install_frozen(model: nn.Module, backend: str | None = None) -> int:
    """The fused op on every experts module it can express (no LoRA); returns how many."""
    n = 0
    for module in model.modules():
        if is_experts(module) and activation_of(module)[0] is not None:
            install_forward(module, _frozen_forward, backend)
            n += 1
    return n


# --------------------------------------------------------------------------------------------
# Patching a PEFT model, and what the report says.


def apply(model: nn.Module, backend: str | None, report: PatchReport) -> set[str]:
    """Route every experts module through the fused op; returns the names of the ParamWrappers
    it handled (the generic LoRA pass leaves those alone). Routers' wrappers are reported."""
    handled: set[str] = set()
    fused = with_lora = 0
    names = {id(m): n for n, m in model.named_modules()}
    for name, module in model.named_modules():
        if not is_experts(module):
            continue
        outer = name
        while outer.endswith(".base_layer"):
            outer = outer.removesuffix(".base_layer")
        top = model.get_submodule(outer)
        experts, wrappers = wrapper_chain(top)
        act, why = activation_of(experts)
        chain = [names[id(w)] for w in wrappers.values()]
        if act is None:
            report.notes.append(f"experts {outer} stay on transformers' loop: {why}")
            report.skipped.update(dict.fromkeys(chain, why))
            handled.update(chain)
            continue
        install_forward(top, _fused_lora_forward if wrappers else _frozen_forward, backend)
        top._lorafuse_name = outer
        fused += 1
        with_lora += bool(wrappers)
        report.patched.extend(chain)
        handled.update(chain)
    for name, module in model.named_modules():
        base, wrappers = wrapper_chain(module)
        if wrappers and is_router(base) and name not in handled:
            report.skipped[name] = ("router LoRA (PEFT's parametrisation of its (E, H) weight: "
                                    "small; the router's top-k stays the model's own)")  # fmt: skip
            handled.add(name)
    if fused:
        report.add_fast_path(FAST_PATH, fused)
    report.notes.extend(lora_summary(model))
    return handled


def lora_summary(model: nn.Module) -> list[str]:
    """Report lines: how many routed expert tensors, routers and shared-expert layers carry LoRA,
    and which expert tensors stay untrained (empty for a model without experts)."""
    from lorafuse.patching import peft_lora

    stacks, trained, routers, routers_lora, untrained = 0, 0, 0, 0, []
    for name, module in model.named_modules():
        if isinstance(module, _param_wrapper()):
            continue
        if is_experts(module):
            parent = model.get_submodule(name.split(".base_layer")[0])
            _, wrappers = wrapper_chain(parent)
            for p in (GATE_UP, DOWN):
                if expert_weight(module, p) is None:
                    continue
                stacks += 1
                if p in wrappers:
                    trained += 1
                else:
                    untrained.append(f"{name.split('.base_layer')[0]}.{p}")
        elif is_router(module):
            routers += 1
            parent = model.get_submodule(name.split(".base_layer")[0])
            routers_lora += bool(wrapper_chain(parent)[1])
    if not stacks:
        return []
    shared = sum(1 for n, m in model.named_modules() if peft_lora.is_lora_layer(m)
                 and "shared" in n and not isinstance(m, _param_wrapper()))  # fmt: skip
    lines = [f"expert LoRA: {trained} of {stacks} routed expert tensors, {routers_lora} of "
             f"{routers} routers, {shared} shared-expert layers carry LoRA"]  # fmt: skip
    if untrained:
        more = f", ... (+{len(untrained) - 4})" if len(untrained) > 4 else ""
        lines.append(f"expert tensors left untrained: {', '.join(untrained[:4])}{more}")
    return lines


def quantized_experts(model: nn.Module) -> bool:
    """Whether any experts module holds NF4 expert stacks."""
    return any(is_quantized(expert_weight(m, DOWN)) for m in model.modules() if is_experts(m))
