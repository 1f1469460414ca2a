"""Which models the decode engine runs, read into one description: the per-family piece.

:func:`read` turns a loaded model (a transformers CausalLM, or a PEFT model around one) into a
:class:`Decoder` (shapes, each layer's projections, norms, RoPE and sliding window), or returns
the one-line reason it cannot. The C++ step (``csrc/decode_engine.h``) is a dense Llama-family
decoder, so :data:`READERS` maps those ``model_type`` s to a reader:

* llama, mistral, qwen2, qwen3, smollm3: RMSNorm, q/k/v/o and SiLU-gated MLP projections (with
  their biases where a config sets them: Qwen2's q/k/v), Qwen3's per-head q/k norms, SmolLM3's
  layers without RoPE, sliding windows per layer (Mistral's config, Qwen2/3's ``layer_types``).

Everything else (Gemma's (1 + w) norms and soft-capping, Phi-3's fused projections, the hybrid
families' recurrent layers, MoE experts, vision-language models, NF4 base layers, DoRA) keeps
generating through the model's own forward; the reason is what :func:`read` returns, and the
callers report it. A new family plugs in here as another reader (and, where its layers are not
Llama's, another C++ step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Layer:
    """One decoder layer: ``proj`` maps q k v o gate up down to the module that computes it (a
    plain ``nn.Linear``, or a PEFT LoRA layer around one); norms as their weights."""

    proj: dict[str, nn.Module]
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    rope: bool
    window: int  # sliding window in tokens (the current one included); 0 = full attention


@dataclass
class Decoder:
    """A dense Llama-family decoder as the engine builds it."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    attn_scale: float
    embed: torch.Tensor  # (vocab, hidden)
    lm_head: nn.Module  # a plain nn.Linear (tied or not)
    norm: torch.Tensor
    layers: list[Layer]
    rotary: nn.Module  # the model's rotary embedding (cos/sin tables come from it)
    model_type: str


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers CausalLM inside ``model`` (a PEFT model's base, else the model)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def base_linear(module: nn.Module) -> nn.Module:
    """The frozen layer under a PEFT LoRA layer (else the module itself)."""
    return getattr(module, "base_layer", module)


def _plain_linear_reason(name: str, module: nn.Module) -> str | None:
    base = base_linear(module)
    if type(base) is not nn.Linear:
        return f"{name} is a {type(base).__name__}, not a plain nn.Linear (an NF4 base layer?)"
    if base.weight.dtype not in _DTYPES or base.weight.device.type != "cpu":
        return f"{name} weight is {base.weight.dtype} on {base.weight.device}"
    if base is not module:
        dora = getattr(module, "use_dora", {})
        if any(dora.values()):
            return f"{name} has a DoRA adapter"
        if any(getattr(module, "lora_bias", {}).values()):
            return f"{name} has a LoRA bias"
    return None


def _window(model_type: str, attn: nn.Module, config) -> int:
    if model_type == "mistral":
        return int(getattr(config, "sliding_window", None) or 0)
    return int(getattr(attn, "sliding_window", None) or 0)


def _read_layer(i: int, layer: nn.Module, model_type: str, config) -> Layer | str:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = {"q": (attn, "q_proj"), "k": (attn, "k_proj"), "v": (attn, "v_proj"),
             "o": (attn, "o_proj"), "gate": (mlp, "gate_proj"), "up": (mlp, "up_proj"),
             "down": (mlp, "down_proj")}  # fmt: skip
    proj = {}
    for key, (parent, attr) in names.items():
        module = getattr(parent, attr, None)
        if module is None:
            return f"layer {i} has no {attr}"
        why = _plain_linear_reason(f"layer {i} {attr}", module)
        if why:
            return why
        proj[key] = module
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    if any(n is None or getattr(n, "weight", None) is None for n in norms):
        return f"layer {i} lacks the RMSNorm layers of a Llama decoder"
    qk = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    q_norm, k_norm = (None if n is None else n.weight for n in qk)
    rope = bool(getattr(attn, "use_rope", True))
    return Layer(proj, norms[0].weight, norms[1].weight, q_norm, k_norm, rope,
                 _window(model_type, attn, config))  # fmt: skip


def _rope_reason(rotary: nn.Module | None) -> str | None:
    if rotary is None:
        return "no rotary embedding module"
    kind = str(getattr(rotary, "rope_type", "default"))
    if "dynamic" in kind or kind == "longrope":
        return f"rope_type {kind!r} changes with the sequence length"
    return None


def _read_llama(model: nn.Module) -> Decoder | str:
    lm = causal_lm(model)
    config, body = lm.config, getattr(lm, "model", None)
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} (the engine's MLP is SiLU)"
    embed, head = getattr(body, "embed_tokens", None), getattr(lm, "lm_head", None)
    if type(embed) is not nn.Embedding or embed.weight.dtype not in _DTYPES:
        return "the token embedding is not a plain nn.Embedding (a quantized embedding?)"
    why = _plain_linear_reason("lm_head", head) if head is not None else "no lm_head"
    if why or base_linear(head) is not head:
        return why or "lm_head carries an adapter"
    why = _rope_reason(getattr(body, "rotary_emb", None))
    if why:
        return why
    layers = []
    for i, layer in enumerate(body.layers):
        got = _read_layer(i, layer, config.model_type, config)
        if isinstance(got, str):
            return got
        layers.append(got)
    attn = body.layers[0].self_attn
    heads = config.num_attention_heads
    return Decoder(
        hidden=config.hidden_size, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=attn.head_dim,
        intermediate=config.intermediate_size, vocab=embed.weight.shape[0],
        eps=float(body.norm.variance_epsilon), attn_scale=float(attn.scaling),
        embed=embed.weight, lm_head=head, norm=body.norm.weight, layers=layers,
        rotary=body.rotary_emb, model_type=config.model_type,
    )  # fmt: skip


READERS = {name: _read_llama for name in ("llama", "mistral", "qwen2", "qwen3", "smollm3")}


def read(model: nn.Module) -> Decoder | str:
    """The :class:`Decoder` of ``model``, or why the engine cannot run it (one line)."""
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    kind = getattr(config, "model_type", None)
    reader = READERS.get(kind)
    if reader is None:
        return f"model_type {kind!r} has no decode-engine reader (engine families: " + (
            ", ".join(READERS) + ")"
        )
    if not type(lm).__name__.endswith("ForCausalLM"):
        return f"{type(lm).__name__} is not a text-only CausalLM"
    return reader(model)
