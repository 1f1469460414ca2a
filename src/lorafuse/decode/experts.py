"""The routed experts of a mixture-of-experts layer as the decode engine runs them.

transformers 5 holds a layer's experts as fused 3-D parameters (``experts.gate_up_proj`` (E, 2I,
H), ``experts.down_proj`` (E, H, I)) beside a router module ``gate`` (weight (E, H));
``csrc/decode_moe.cpp`` reads them as stacked rows. :func:`read` takes one block (or says why
not: LoRA on the experts, another router, shared experts, biased or unfused experts) and
:func:`options` the routing rule of the model's routers.
"""

from __future__ import annotations

import torch
from torch import nn

# routers that take the softmax over every expert's logit (LFM2-MoE: the sigmoid of each, the
# block's expert bias steering the choice), then the top k (renormalised where the router's
# norm_topk_prob says; Mixtral's always): what csrc/decode_moe.cpp computes
ROUTERS = {"Qwen3MoeTopKRouter": None, "OlmoeTopKRouter": None, "MixtralTopKRouter": True,
            "Lfm2MoeTopKRouter": None}  # fmt: skip


def is_moe(mlp: nn.Module | None) -> bool:
    """Whether a layer's MLP is a routed-experts block (transformers 5: ``gate`` + ``experts``)."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def read(
    i: int, mlp: nn.Module, dtypes: tuple
) -> tuple[torch.Tensor, nn.Module, torch.Tensor] | str:
    """Layer ``i``'s MoE block ``mlp``: its router weight (experts, hidden), experts module and
    expert bias (None: none), or why the engine cannot run it (experts in ``dtypes`` only)."""
    experts, router = mlp.experts, mlp.gate
    if hasattr(experts, "base_layer") or hasattr(experts, "lora_A"):
        return (f"layer {i}'s experts carry LoRA adapters (PEFT target_parameters); the engine "
                "applies adapters to attention and dense MLP projections only")  # fmt: skip
    if type(router).__name__ not in ROUTERS or hasattr(router, "lora_A"):
        return (
            f"layer {i}'s router is a {type(router).__name__} (the engine has {', '.join(ROUTERS)})"
        )
    if hasattr(mlp, "shared_expert") or hasattr(mlp, "shared_experts"):
        return f"layer {i} has a shared expert"
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    ok = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    if not ok or gate_up.dim() != 3 or down.dim() != 3 or hasattr(experts, "gate_up_proj_bias"):
        return f"layer {i}'s experts are not fused (E, 2I, H) / (E, H, I) tensors without bias"
    if gate_up.dtype not in dtypes or gate_up.device.type != "cpu":
        return f"layer {i}'s experts are {gate_up.dtype} on {gate_up.device}"
    bias = mlp.expert_bias if getattr(mlp, "use_expert_bias", False) else None
    return router.weight, experts, bias


def options(mlp: nn.Module) -> dict:
    """``DecodeModel.set_moe``'s keyword arguments for a model whose sparse blocks are ``mlp``'s."""
    experts, router = mlp.experts, mlp.gate
    norm = ROUTERS[type(router).__name__]
    norm = bool(router.norm_topk_prob) if norm is None else norm
    sigmoid = type(router).__name__ == "Lfm2MoeTopKRouter"  # w / (sum + 1e-6) · scale
    return dict(experts=experts.gate_up_proj.shape[0], intermediate=experts.down_proj.shape[2],
                top_k=int(router.top_k), norm_topk=norm, sigmoid=sigmoid,
                norm_eps=1e-6 if sigmoid else 0.0,
                scale=float(getattr(router, "routed_scaling_factor", None) or 1.0))  # fmt: skip
