"""Which models the decode engine runs, read into one description: the per-family piece.

:func:`read` turns a loaded model (a transformers CausalLM, or a PEFT model around one) into a
:class:`Decoder` (shapes, each layer's projections, norms, RoPE table and sliding window, and the
family's options), or returns the one-line reason it cannot. The C++ step
(``csrc/decode_engine.h``) is one decoder whose family differences are data: which of a
layer's four norms exist, per-head or whole-projection q/k norms, the MLP's gate activation,
embedding / residual / logit scales, attention and final-logit soft-capping, one RoPE table per
layer type, partial rotary, a layer's routed experts in place of its MLP, a layer's short
convolution in place of its attention. :data:`FAMILIES` maps ``model_type`` s to what differs:

* llama, mistral, qwen2, qwen3, smollm3: RMSNorm before attention and MLP, q/k/v/o and
  SiLU-gated MLP projections (with their biases where a config sets them: Qwen2's q/k/v),
  Qwen3's per-head q/k norms, SmolLM3's layers without RoPE, sliding windows per layer
  (Mistral's config, Qwen2/3's ``layer_types``).
* gemma, gemma2, gemma3_text: (1 + w) RMSNorms, embeddings times sqrt(hidden), GELU-tanh
  gate, ``query_pre_attn_scalar``; Gemma 2/3 add norms after attention and MLP, Gemma 2 its
  attention-logit and final-logit soft-capping, Gemma 3 per-head q/k norms and its local RoPE
  base on the sliding-window layers.
* olmo2, olmo3: norms after attention and MLP only (none before), q/k norms over the whole
  projection; OLMo 3's sliding-window layers with their own RoPE table.
* granite: embedding, residual and attention multipliers and the logits divisor.
* phi3: the fused qkv and gate_up projections split by rows at read time (an adapter on a fused
  module: its B split the same way, A shared), partial rotary.
* qwen3_moe, mixtral, olmoe: routed experts in place of the dense MLP (every layer, or those
  the config makes sparse): the router's softmax, top k, renormalised where ``norm_topk_prob``
  says (Mixtral: always), the experts' fused 3-D tensors read as stacked rows; OLMoE's q/k norms
  over the whole projection, Mixtral's sliding window.
* lfm2, lfm2_moe: short-convolution layers in attention's place (in_proj -> B, C, x; C · causal
  depthwise conv(B · x) over the last L positions; out_proj), the other layers attention with
  per-head q/k norms; its own module names (operator_norm, feed_forward.w1/w3/w2, out_proj,
  embedding_norm as the final norm); LFM2-MoE's sparse layers: sigmoid router scores, an expert
  bias that steers the choice only, the routed scaling factor.

Everything else (Gemma 3n/4's per-layer embeddings and shared KV, rope types that change with
the sequence length such as Phi-3's longrope, the other hybrids' recurrent layers (Gated
DeltaNet, Mamba2), LoRA on MoE experts (PEFT ``target_parameters``), shared
experts and other routers, vision-language models, NF4 base layers, DoRA) keeps generating
through the model's own forward; the reason is what :func:`read` returns, and the callers
report it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from lorafuse.decode import experts

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down", "conv_in", "conv_out")
NORMS = ("in_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACTS = {"SiLU": 0, "SiLUActivation": 0, "GELUTanh": 1}  # the C++ step's gate activations


@dataclass
class Layer:
    """One decoder layer: ``proj`` maps q k v o gate up down to the module that computes it (a
    plain ``nn.Linear``, or a PEFT LoRA layer around one) and ``rows`` the rows of that module's
    output it is (Phi-3's fused modules; absent: all); ``norms`` the RMSNorm weights it has
    (:data:`NORMS`, fp32, Gemma's 1 + w already added)."""

    proj: dict[str, nn.Module]
    rows: dict[str, slice]
    norms: dict[str, torch.Tensor]
    q_norm: torch.Tensor | None  # (head_dim,) per head or (heads·head_dim,) whole (OLMo)
    k_norm: torch.Tensor | None
    rope: bool
    window: int  # sliding window in tokens (the current one included); 0 = full attention
    rope_table: int = 0  # index into Decoder.ropes
    router: torch.Tensor | None = None  # a MoE layer's (experts, hidden); proj then lacks the MLP
    experts: nn.Module | None = None  # its gate_up_proj (E, 2I, hidden), down_proj (E, hidden, I)
    expert_bias: torch.Tensor | None = None  # (experts,) added to the scores to choose (LFM2-MoE)
    conv: nn.Module | None = None  # a short-convolution layer's nn.Conv1d (LFM2): proj has
    # conv_in / conv_out (its in_proj (3·hidden, hidden) and out_proj) in q/k/v/o's place


@dataclass
class Decoder:
    """A dense decoder as the engine builds it."""

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
    ropes: list[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]  # pos -> cos, sin
    model_type: str
    options: dict = field(default_factory=dict)  # DecodeModel.set_options' keyword arguments
    moe: dict | None = None  # DecodeModel.set_moe's keyword arguments (a model with experts)


@dataclass(frozen=True)
class Family:
    """What a ``model_type`` changes in the reading: the engine's norm -> the layer's attribute,
    Gemma's (1 + w) norms, Phi-3's fused projections, the family's options."""

    norms: dict[str, str]
    unit_offset: bool = False
    fused: bool = False
    options: Callable | None = None  # (config, body) -> extra options
    names: dict = field(default_factory=dict)  # projection -> its attribute where not Llama's
    attn: str = "self_attn"  # the layer's attention and MLP attributes
    mlp: str = "mlp"
    qk_norms: tuple[str, str] = ("q_norm", "k_norm")
    final_norm: str = "norm"
    rotary: str = "rotary_emb"
    act: str | None = None  # the MLP's activation where its module holds none (LFM2: F.silu)


_PRE = {"in_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_SANDWICH = {"in_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}  # fmt: skip
_POST = {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}


def _gemma_options(config, body) -> dict:
    embed = body.embed_tokens  # Gemma's scaled embedding: weight · scale in the weight's dtype
    scale = embed.embed_scale.to(embed.weight.dtype).float().item()
    return dict(embed_scale=scale, attn_softcap=float(getattr(config, "attn_logit_softcapping",
                None) or 0.0), logit_softcap=float(getattr(config, "final_logit_softcapping",
                None) or 0.0))  # fmt: skip


def _granite_options(config, body) -> dict:
    return dict(embed_scale=float(config.embedding_multiplier),
                residual_scale=float(config.residual_multiplier),
                logit_divisor=float(config.logits_scaling))  # fmt: skip


_LFM2 = Family({"in_norm": "operator_norm", "mlp_norm": "ffn_norm"}, mlp="feed_forward",
               names={"o": "out_proj", "gate": "w1", "up": "w3", "down": "w2"},
               qk_norms=("q_layernorm", "k_layernorm"), final_norm="embedding_norm",
               act="SiLU")  # fmt: skip
FAMILIES = {
    **{name: Family(_PRE) for name in ("llama", "mistral", "qwen2", "qwen3", "smollm3")},
    "gemma": Family(_PRE, unit_offset=True, options=_gemma_options),
    "gemma2": Family(_SANDWICH, unit_offset=True, options=_gemma_options),
    "gemma3_text": Family(_SANDWICH, unit_offset=True, options=_gemma_options),
    "olmo2": Family(_POST),
    "olmo3": Family(_POST),
    "granite": Family(_PRE, options=_granite_options),
    "phi3": Family(_PRE, fused=True),
    **{name: Family(_PRE) for name in ("qwen3_moe", "mixtral", "olmoe")},
    "lfm2": _LFM2,
    "lfm2_moe": replace(_LFM2, rotary="pos_emb"),
}
# families the step does not have, with what it lacks for them
_LACKS = {
    "gemma4_text": "Gemma 4's per-layer input embeddings, KV shared across layers, k = v "
    "attention and MoE block are not in the engine's step",
    "gemma3n_text": "Gemma 3n's per-layer input embeddings, AltUp and shared KV are not in the "
    "engine's step",
}


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


def _norm_weight(module: nn.Module | None, unit_offset: bool) -> torch.Tensor | None:
    if module is None:
        return None
    w = module.weight.detach()
    return 1.0 + w.float() if unit_offset else w  # Gemma: output · (1 + w), w in fp32


def _window(model_type: str, attn: nn.Module, config) -> int:
    if model_type in ("mistral", "phi3", "mixtral"):  # every layer: the config's window
        return int(getattr(config, "sliding_window", None) or 0)
    return int(getattr(attn, "sliding_window", None) or 0)


def _projections(i: int, layer, family: Family, config, moe: bool) -> tuple[dict, dict] | str:
    attn, mlp = getattr(layer, family.attn, None), getattr(layer, family.mlp, None)
    if family.fused:  # Phi-3: q|k|v rows of qkv_proj, gate|up rows of gate_up_proj
        qd = config.num_attention_heads * attn.head_dim
        kvd = config.num_key_value_heads * attn.head_dim
        inter = config.intermediate_size
        names = {"q": (attn, "qkv_proj"), "k": (attn, "qkv_proj"), "v": (attn, "qkv_proj"),
                 "o": (attn, "o_proj"), "gate": (mlp, "gate_up_proj"),
                 "up": (mlp, "gate_up_proj"), "down": (mlp, "down_proj")}  # fmt: skip
        rows = {"q": slice(0, qd), "k": slice(qd, qd + kvd), "v": slice(qd + kvd, qd + 2 * kvd),
                "gate": slice(0, inter), "up": slice(inter, 2 * inter)}  # fmt: skip
    else:
        names = {"q": (attn, "q_proj"), "k": (attn, "k_proj"), "v": (attn, "v_proj"),
                 "o": (attn, "o_proj"), "gate": (mlp, "gate_proj"), "up": (mlp, "up_proj"),
                 "down": (mlp, "down_proj")}  # fmt: skip
        names = {k: (parent, family.names.get(k, attr)) for k, (parent, attr) in names.items()}
        rows = {}
    if attn is None and hasattr(layer, "conv"):  # LFM2: a short convolution in attention's place
        names = {"conv_in": (layer.conv, "in_proj"), "conv_out": (layer.conv, "out_proj"),
                 **{k: v for k, v in names.items() if k in ("gate", "up", "down")}}  # fmt: skip
    if moe:  # the experts are the MLP (_read_moe)
        names = {k: v for k, v in names.items() if k not in ("gate", "up", "down")}
    proj = {}
    for key, (parent, attr) in names.items():
        module = getattr(parent, attr, None)
        if module is None:
            return f"layer {i} has no {attr}"
        why = _plain_linear_reason(f"layer {i} {attr}", module)
        if why:
            return why
        proj[key] = module
    return proj, rows


def _read_layer(i: int, layer: nn.Module, family: Family, config, typed: bool) -> Layer | str:
    """Layer ``i``; ``typed``: the model has one RoPE table per layer type."""
    attn, mlp = getattr(layer, family.attn, None), getattr(layer, family.mlp, None)
    moe = experts.read(i, mlp, _DTYPES) if experts.is_moe(mlp) else None
    if isinstance(moe, str):
        return moe
    got = _projections(i, layer, family, config, moe is not None)
    if isinstance(got, str):
        return got
    conv = None if attn is not None else _read_conv(i, layer)
    if isinstance(conv, str):
        return conv
    norms = {}
    for name, attr in family.norms.items():
        module = getattr(layer, attr, None)
        if module is None or getattr(module, "weight", None) is None:
            return f"layer {i} lacks the {attr} RMSNorm its family has"
        norms[name] = _norm_weight(module, family.unit_offset)
    q_norm, k_norm = (_norm_weight(getattr(attn, n, None), family.unit_offset)
                      for n in family.qk_norms)  # fmt: skip
    rope = bool(getattr(attn, "use_rope", True))
    types = config.layer_types if typed else None
    table = 0 if types is None else sorted(set(types)).index(types[i])
    return Layer(*got, norms, q_norm, k_norm, rope, _window(config.model_type, attn, config),
                 table, *(moe or (None, None, None)), conv)  # fmt: skip


def _read_conv(i: int, layer: nn.Module) -> nn.Module | str:
    """LFM2's short-convolution layer: its depthwise causal nn.Conv1d (hidden, 1, L)."""
    conv = getattr(getattr(layer, "conv", None), "conv", None)
    if type(conv) is not nn.Conv1d or conv.groups != conv.in_channels or conv.weight.shape[1] != 1:
        return f"layer {i} has neither attention nor a depthwise short convolution"
    if conv.weight.dtype not in _DTYPES or conv.weight.device.type != "cpu":
        return f"layer {i} conv weight is {conv.weight.dtype} on {conv.weight.device}"
    return conv


def _ropes(rotary: nn.Module | None, config) -> list | str:
    """One cos/sin function per RoPE table (Gemma 3 / OLMo 3: one per layer type, sorted)."""
    if rotary is None:
        return "no rotary embedding module"
    kinds = getattr(rotary, "rope_type", "default")
    for kind in kinds.values() if isinstance(kinds, dict) else [kinds]:
        if "dynamic" in str(kind) or kind == "longrope":
            return f"rope_type {kind!r} changes with the sequence length"
    x = torch.zeros(1, dtype=torch.float32)
    if isinstance(kinds, dict):  # forward(x, position_ids, layer_type)
        return [lambda pos, t=t: rotary(x, pos, t) for t in sorted(set(config.layer_types))]
    return [lambda pos: rotary(x, pos)]


def _model_reason(lm: nn.Module, config, body, family: Family) -> str | None:
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (an embedding model)"
    embed, head = getattr(body, "embed_tokens", None), getattr(lm, "lm_head", None)
    plain = type(embed) is nn.Embedding or type(embed).__name__.endswith("ScaledWordEmbedding")
    if not plain or embed.weight.dtype not in _DTYPES:
        return "the token embedding is not a plain nn.Embedding (a quantized embedding?)"
    why = _plain_linear_reason("lm_head", head) if head is not None else "no lm_head"
    if why or base_linear(head) is not head:
        return why or "lm_head carries an adapter"
    if getattr(config, "clip_qkv", None) is not None:
        return "clip_qkv (OLMoE's q/k/v clamp) is not in the engine's step"
    for layer in body.layers:
        act = _act(layer, family)
        if act not in _ACTS:
            return f"MLP activation {act} (the engine has SiLU and GELU-tanh gates)"
    return None


def _act(layer: nn.Module, family: Family) -> str:
    """The name of the gate activation of a layer's dense MLP or of its MoE block's experts."""
    if family.act:
        return family.act
    mlp = getattr(layer, family.mlp, None)
    if experts.is_moe(mlp):
        mlp = mlp.experts
        while hasattr(mlp, "base_layer"):  # PEFT's ParamWrappers around the experts
            mlp = mlp.base_layer
    return type(getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)).__name__


def _read(model: nn.Module, family: Family) -> Decoder | str:
    lm = causal_lm(model)
    config, body = lm.config, getattr(lm, "model", None)
    why = _model_reason(lm, config, body, family)
    if why:
        return why
    ropes = _ropes(getattr(body, family.rotary, None), config)
    if isinstance(ropes, str):
        return ropes
    layers = []
    for i, layer in enumerate(body.layers):
        got = _read_layer(i, layer, family, config, len(ropes) > 1)
        if isinstance(got, str):
            return got
        layers.append(got)
    attn = next(a for a in (getattr(x, family.attn, None) for x in body.layers) if a is not None)
    acts = {_act(layer, family) for layer in body.layers}
    if len({_ACTS[a] for a in acts}) > 1:
        return f"MLP activations differ between layers ({sorted(acts)})"
    options = {"act": _ACTS[acts.pop()]}
    sparse = [m for m in (getattr(x, family.mlp, None) for x in body.layers) if experts.is_moe(m)]
    dense = [x for x in layers if "gate" in x.proj]  # the intermediate size as its weight has it
    gate = dense[0].proj["gate"] if dense else None
    inter = base_linear(gate).weight[dense[0].rows.get("gate", slice(None))].shape[0] if gate else 1
    options.update(family.options(config, body) if family.options else {})
    heads, norm = config.num_attention_heads, getattr(body, family.final_norm)
    return Decoder(
        hidden=config.hidden_size, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=attn.head_dim,
        intermediate=inter,
        vocab=body.embed_tokens.weight.shape[0],
        eps=float(getattr(norm, "variance_epsilon", None) or norm.eps),
        attn_scale=float(attn.scaling), embed=body.embed_tokens.weight, lm_head=lm.lm_head,
        norm=_norm_weight(norm, family.unit_offset), layers=layers, ropes=ropes,
        model_type=config.model_type, options=options,
        moe=experts.options(sparse[0]) if sparse else None,
    )  # fmt: skip


def read(model: nn.Module) -> Decoder | str:
    """The :class:`Decoder` of ``model``, or why the engine cannot run it (one line)."""
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    kind = getattr(config, "model_type", None)
    family = FAMILIES.get(kind)
    if family is None:
        lacks = _LACKS.get(kind, "engine families: " + ", ".join(FAMILIES))
        return f"model_type {kind!r} has no decode-engine reader ({lacks})"
    if not type(lm).__name__.endswith("ForCausalLM"):
        return f"{type(lm).__name__} is not a text-only CausalLM"
    return _read(model, family)
