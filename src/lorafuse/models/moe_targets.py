"""Which parts of a mixture-of-experts model LoRA reaches: the routed experts' fused 3-D tensors
and the routers through PEFT's ``target_parameters``, the shared experts through
``target_modules`` (they are ``nn.Linear``).

transformers 5 stores routed experts as parameters, not Linears, so ``target_modules`` (names or
``"all-linear"``) alone leaves them frozen on gpt-oss, Granite 4, LFM2-MoE and Qwen3.5-MoE, and
on Qwen3-MoE / Qwen3-Next PEFT's own transformers-v5 conversion (``peft.utils.
transformers_weight_conversion``) silently re-maps ``gate_proj`` / ``up_proj`` / ``down_proj`` /
``gate`` to the routed experts and the router, whichever module the name meant. :func:`plan`
makes the set explicit instead: the adapter config lists every expert tensor by name, names that
PEFT would re-map are kept out of ``target_modules`` (a shared expert with those names then
cannot carry LoRA in stock PEFT; the plan says so), and ``untrained`` names every expert part left
frozen, for the report and the training log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lorafuse.errors import SettingError
from lorafuse.patching import moe


@dataclass
class ExpertPlan:
    """The LoRA targets of an MoE model (all empty for a dense one)."""

    target_parameters: list[str] = field(default_factory=list)  # "mlp.experts.gate_up_proj", ...
    shared: list[str] = field(default_factory=list)  # shared-expert Linear names to target
    remapped: list[str] = field(default_factory=list)  # names PEFT re-maps (kept out of targets)
    untrained: list[str] = field(default_factory=list)  # expert parts left frozen, with why

    @property
    def has_experts(self) -> bool:
        return bool(self.target_parameters or self.untrained)


def _local(model: nn.Module, name: str) -> str:
    """``parent.child`` of a qualified module name: how PEFT's suffix match names it in every
    layer (``model.layers.3.mlp.experts`` -> ``mlp.experts``)."""
    return ".".join(name.split(".")[-2:])


def peft_remapped_names(model: nn.Module) -> set[str]:
    """Module names PEFT's transformers-v5 conversion turns into expert/router parameters for
    this architecture (``gate_proj``, ``up_proj``, ``down_proj``, ``gate`` on Qwen3-MoE /
    Qwen3-Next); empty where no conversion applies or PEFT has none."""
    try:
        from peft.utils import transformers_weight_conversion as conv
    except ImportError:
        return set()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if conv.get_checkpoint_conversion_mapping(model_type) is None:
        return set()
    base = conv._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    return set(conv._MOE_TARGET_MODULE_MAPPING.get(base, {}))


def plan(model: nn.Module, expert_lora: bool = True) -> ExpertPlan:
    """The expert targets of ``model`` (``expert_lora=False``: none, every expert part named
    untrained)."""
    out = ExpertPlan()
    remapped = peft_remapped_names(model)
    experts, routers, shared = {}, {}, {}
    for name, module in model.named_modules():
        if moe.is_experts(module):
            for p in (moe.GATE_UP, moe.DOWN):
                if moe.expert_weight(module, p) is not None:
                    experts[f"{_local(model, name)}.{p}"] = None
        elif moe.is_router(module):
            routers[f"{_local(model, name)}.weight"] = None
        elif isinstance(module, nn.Linear) and "shared" in name:
            shared[name.rsplit(".", 1)[-1]] = None
    if not experts:
        return out
    off = "expert_lora=False"
    if expert_lora:
        out.target_parameters = [*experts, *routers]
    else:
        out.untrained += [f"{t} ({off})" for t in [*experts, *routers]]
    for leaf in shared:
        if leaf in remapped:
            out.remapped.append(leaf)
            out.untrained.append(
                f"shared expert {leaf} (PEFT re-maps the name {leaf!r} to the routed experts "
                f"on {model.config.model_type}: no LoRA of its own in stock PEFT)"
            )
        else:
            out.shared.append(leaf)
    return out


def linear_names(model: nn.Module) -> list[str]:
    """Leaf names of every ``nn.Linear`` but the output head (what PEFT's ``"all-linear"``
    targets), in model order."""
    head = model.get_output_embeddings()
    names = {n.rsplit(".", 1)[-1]: None for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and m is not head}  # fmt: skip
    return list(names)


def check_options(plan_: ExpertPlan, lora_dropout: float, options: dict) -> None:
    """PEFT's ParamWrapper (LoRA on a parameter) takes no dropout, DoRA or lora_bias: one clear
    line instead of its error deep inside ``get_peft_model``."""
    if not plan_.target_parameters:
        return
    bad = [f"lora_dropout={lora_dropout}"] if lora_dropout else []
    bad += [k for k in ("use_dora", "lora_bias") if options.get(k)]
    if bad:
        raise SettingError(
            f"{', '.join(bad)}: PEFT's LoRA on expert tensors (target_parameters) supports none "
            "of these; drop them or turn expert LoRA off (expert_lora=False / --no-expert-lora)"
        )
