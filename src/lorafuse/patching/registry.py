"""The registry of per-architecture fast paths: :data:`REGISTRY` maps ``config.model_type`` to an
:class:`ArchSpec`, which says where the transformers classes live whose *instances* get a fused
forward (classes are matched exactly, so a subclass with its own forward is never patched by
mistake), how the architecture's norm, attention and MLP differ from Llama's, and which fast paths
(``parts``) fit it; ``stock`` says why each missing one runs stock transformers.

llama, mistral, qwen2, qwen3, smollm3 in full; phi3 (norm, attention on ``qkv_proj``'s row blocks,
MLP on ``gate_up_proj``'s halves, loss), gemma2 and gemma3_text ((1 + w) norm on fp32 weights,
GeGLU MLP, loss with final-logit soft-capping) in part; the language decoders of idefics3,
qwen2_vl and qwen2_5_vl; the late-2026 families (:data:`REGISTRY_2026`, their attention, MLP,
norms and loss; their token mixers and expert blocks are named in ``mixers`` and reported). The
forwards are :mod:`lorafuse.patching.fused_forwards` (norm, MLP, loss) and
:mod:`lorafuse.patching.attention`; applying the registry to a model is
:func:`lorafuse.patching.fast_paths.apply_fast_paths`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

ALL_PARTS = frozenset(("rms_norm", "mlp", "attention", "loss", "decode_step"))
TRAINING_PARTS = ALL_PARTS - {"decode_step"}
# How a family's RMSNorm rounds: "llama" w * round(norm(x)); "offset" round(norm(x) * (1 + w)) in
# fp32 (Gemma 2/3, Qwen3.5, Qwen3-Next); "fp32" round(norm(x) * w) in fp32 (Gemma 4, OLMo 3).
NORMS = ("llama", "offset", "fp32")


@dataclass(frozen=True)
class ArchSpec:
    """Where an architecture's classes live, how its norm / attention / MLP differ from Llama's,
    and which fast paths fit it (``parts``; ``stock`` says why each missing one runs stock)."""

    prefix: str  # class-name prefix: "Llama" -> LlamaRMSNorm, LlamaAttention, ...
    module: str  # the transformers modeling module
    qk_norm: bool | str = False  # True: RMSNorm per head of q and k (Qwen3); "whole": over the
    # whole projection before the head split (OLMo 3)
    sliding: str | None = (
        None  # "config": config.sliding_window (Mistral); "attr": self.sliding_window
    )
    rope_attr: bool = False  # SmolLM3: RoPE only where self.use_rope (NoPE layers)
    gate_up: bool = False  # one stacked gate/up projection (gate rows first): Phi-3, Granite 4
    fused_qkv: bool = False  # Phi-3: one qkv_proj (q rows, then k, then v) instead of q/k/v
    norm: str = "llama"  # one of NORMS
    attn_softcap: bool = False  # Gemma 2: attention logits soft-capped (the model's interface)
    parts: frozenset = ALL_PARTS
    stock: tuple[str, ...] = ()  # one line per fast path left out, with the reason
    classes: tuple[tuple[str, str], ...] = ()  # (suffix, class name) where not <prefix><suffix>
    head: tuple[str, str] | None = (
        None  # (module, class) with the loss when not <prefix>ForCausalLM
    )
    notes: tuple[str, ...] = ()  # facts the report states (how a rope variant is handled)
    qk_names: tuple[str, str] = ("q_norm", "k_norm")  # LFM2: q_layernorm, k_layernorm
    o_proj: str = "o_proj"  # LFM2: out_proj
    q_gate: bool = False  # Qwen3.5 / Qwen3-Next: q_proj yields (q, gate) per head, output gated
    v_norm: bool = False  # Gemma 4: an unscaled RMSNorm on v
    shared_kv: bool = False  # Gemma 4: the last layers reuse earlier layers' k/v; k = v options
    sinks: bool = False  # gpt-oss: per-head attention sinks (s_aux), the model's interface only
    half_rope: bool = False  # gpt-oss: cos/sin of head_dim / 2 (the two halves share them)
    mlp_names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")  # gate_up: (stacked, down)
    activation: str | None = None  # the MLP's activation when fixed in code (LFM2: silu)
    act_attr: str = "hidden_act"  # else the config attribute naming it (Gemma: hidden_activation)
    mixers: tuple[tuple[str, str], ...] = ()  # (class, what it is): token mixers / expert blocks
    # this registry leaves to their own patchers (the report names each one left stock)

    def cls(self, suffix: str):
        names = dict(self.classes)
        if suffix == "ForCausalLM" and self.head:
            return getattr(importlib.import_module(self.head[0]), self.head[1], None)
        name = names.get(suffix, self.prefix + suffix)
        return getattr(importlib.import_module(self.module), name, None)


_PHI3_STOCK = (
    "phi3 attention: lora_qkv on qkv_proj's row blocks (q, k, v; one lora_A shared, as PEFT's one "
    "product), rope on the rotary part only (partial_rotary_factor), with the model's own cos/sin "
    "(longrope scaling included); under lora_dropout > 0 in training qkv_proj runs its fused LoRA "
    "Linear (PEFT draws one mask for q, k and v)",
    "phi3 mlp: lora_mlp on gate_up_proj's row halves, except under lora_dropout > 0 in "
    "training (one dropout mask shared by gate and up; then its fused LoRA Linear, warned)",
    "phi3 decoding step stays stock (not written for fused qkv_proj)",
)
_GEMMA_STOCK = (
    "{p} mlp: lora_mlp with the GeGLU (gelu-tanh) activation, whose kernel is torch's (no C++ / "
    "Triton one); stock under torch.compile",
    "{p} attention: lora_qkv{qk} and rope fused, scaled by query_pre_attn_scalar; {attn}",
    "{p} decoding step stays stock (not written for Gemma's norms and scaling)",
)
REGISTRY: dict[str, ArchSpec] = {
    "llama": ArchSpec("Llama", "transformers.models.llama.modeling_llama"),
    "mistral": ArchSpec(
        "Mistral", "transformers.models.mistral.modeling_mistral", sliding="config"
    ),
    "qwen2": ArchSpec("Qwen2", "transformers.models.qwen2.modeling_qwen2", sliding="attr"),
    "qwen3": ArchSpec("Qwen3", "transformers.models.qwen3.modeling_qwen3", True, "attr"),
    "smollm3": ArchSpec(
        "SmolLM3",
        "transformers.models.smollm3.modeling_smollm3",
        sliding="attr",
        rope_attr=True,
        parts=ALL_PARTS - {"decode_step"},
        stock=("smollm3 decoding step stays stock (it applies RoPE on every layer)",),
    ),
    "phi3": ArchSpec(
        "Phi3",
        "transformers.models.phi3.modeling_phi3",
        sliding="config",
        gate_up=True,
        fused_qkv=True,
        mlp_names=("gate_up_proj", "down_proj"),
        parts=ALL_PARTS - {"decode_step"},
        stock=_PHI3_STOCK,
    ),
    "gemma2": ArchSpec(
        "Gemma2",
        "transformers.models.gemma2.modeling_gemma2",
        sliding="attr",
        norm="offset",
        attn_softcap=True,
        act_attr="hidden_activation",
        parts=ALL_PARTS - {"decode_step"},  # the loss soft-capped
        stock=tuple(
            s.format(
                p="gemma2",
                qk="",
                attn="the soft-capped attention itself through the model's own interface",
            )
            for s in _GEMMA_STOCK
        ),  # fmt: skip
    ),
    "gemma3_text": ArchSpec(
        "Gemma3",
        "transformers.models.gemma3.modeling_gemma3",
        qk_norm=True,
        sliding="attr",
        norm="offset",
        act_attr="hidden_activation",
        parts=ALL_PARTS - {"decode_step"},
        stock=tuple(
            s.format(p="gemma3_text", qk=", q/k norms", attn="causal attention as Llama's")
            for s in _GEMMA_STOCK
        ),  # fmt: skip
    ),
}
# Vision-language models: the fast paths on the language decoder (the vision tower keeps its own
# forward; its LoRA Linears are fused). The loss is the head model's (``*ForConditionalGeneration``).
_VLM_PARTS = ALL_PARTS - {"decode_step"}
_VLM_STOCK = ("{p} decoding step stays stock (the vision-language model's generate path)",)
_MROPE = (
    "{p} multimodal rope: transformers' rotary module composes the (time, height, width) sections "
    "into one cos/sin per token, so the fused rope on it is exact",
)
REGISTRY |= {
    "idefics3": ArchSpec(
        "Llama", "transformers.models.llama.modeling_llama", parts=_VLM_PARTS,
        stock=(_VLM_STOCK[0].format(p="idefics3"),),
        head=("transformers.models.idefics3.modeling_idefics3", "Idefics3ForConditionalGeneration"),
    ),
    "qwen2_vl": ArchSpec(
        "Qwen2VL", "transformers.models.qwen2_vl.modeling_qwen2_vl", sliding="attr",
        parts=_VLM_PARTS, stock=(_VLM_STOCK[0].format(p="qwen2_vl"),), classes=(("MLP", "Qwen2MLP"),),
        head=("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLForConditionalGeneration"),
        notes=(_MROPE[0].format(p="qwen2_vl"),),
    ),
    "qwen2_5_vl": ArchSpec(
        "Qwen2_5_VL", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", sliding="attr",
        parts=_VLM_PARTS, stock=(_VLM_STOCK[0].format(p="qwen2_5_vl"),), classes=(("MLP", "Qwen2MLP"),),
        head=(
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
            "Qwen2_5_VLForConditionalGeneration",
        ),
        notes=(_MROPE[0].format(p="qwen2_5_vl"),),
    ),
}  # fmt: skip
# The late-2026 families: attention (gated, partial rotary, shared KV, sinks...), MLP, norms and
# loss here; the token mixers that carry state along the sequence and the expert blocks are
# ``mixers``, left to their own patchers (the report names every one still on stock code).
_M = "transformers.models.{0}.modeling_{0}"
_GDN = ("GatedDeltaNet", "Gated DeltaNet linear attention (conv1d, delta rule, gated norm)")
_NO_DECODE = "{p} decoding step stays stock (the hybrid's recurrent cache is the model's own)"
REGISTRY_2026: dict[str, ArchSpec] = {
    "qwen3_5_text": ArchSpec(
        "Qwen3_5", _M.format("qwen3_5"), qk_norm=True, norm="offset", q_gate=True,
        parts=TRAINING_PARTS, stock=(_NO_DECODE.format(p="qwen3_5_text"),),
        mixers=(("Qwen3_5" + _GDN[0], _GDN[1]),),
    ),
    "qwen3_5": ArchSpec(  # the vision-language model: its language decoder, the loss its head's
        "Qwen3_5", _M.format("qwen3_5"), qk_norm=True, norm="offset", q_gate=True,
        parts=TRAINING_PARTS, head=(_M.format("qwen3_5"), "Qwen3_5ForConditionalGeneration"),
        stock=("qwen3_5 decoding step stays stock (the vision-language model's generate path)",),
        notes=(_MROPE[0].format(p="qwen3_5"),), mixers=(("Qwen3_5" + _GDN[0], _GDN[1]),),
    ),
    "qwen3_next": ArchSpec(
        "Qwen3Next", _M.format("qwen3_next"), qk_norm=True, norm="offset", q_gate=True,
        parts=TRAINING_PARTS, stock=(_NO_DECODE.format(p="qwen3_next"),),
        mixers=(("Qwen3Next" + _GDN[0], _GDN[1]),
                ("Qwen3NextSparseMoeBlock", "MoE block (router and experts; its shared expert "
                 "is a Qwen3NextMLP and takes the fused MLP)")),
    ),
    "lfm2": ArchSpec(
        "Lfm2", _M.format("lfm2"), qk_norm=True, qk_names=("q_layernorm", "k_layernorm"),
        o_proj="out_proj", mlp_names=("w1", "w3", "w2"), activation="silu",
        parts=TRAINING_PARTS, stock=(_NO_DECODE.format(p="lfm2"),),
        mixers=(("Lfm2ShortConv", "gated short convolution"),),
    ),
    "granitemoehybrid": ArchSpec(
        "GraniteMoeHybrid", _M.format("granitemoehybrid"), gate_up=True,
        mlp_names=("input_linear", "output_linear"), parts=TRAINING_PARTS,
        stock=(_NO_DECODE.format(p="granitemoehybrid"),),
        notes=("granitemoehybrid: the shared MLP (input_linear halves, output_linear) takes "
               "lora_mlp; the loss divides the logits by logits_scaling as the model does (the "
               "hidden states are divided before the head: the same product up to rounding)",),
        mixers=(("GraniteMoeHybridMambaLayer", "Mamba2 mixer"),
                ("GraniteMoeHybridMoE", "MoE block (router and experts)")),
    ),
    "gemma4_text": ArchSpec(
        "Gemma4", _M.format("gemma4"), qk_norm=True, sliding="attr", norm="fp32", v_norm=True,
        shared_kv=True, act_attr="hidden_activation", parts=TRAINING_PARTS,
        classes=(("Attention", "Gemma4TextAttention"), ("MLP", "Gemma4TextMLP")),
        stock=("gemma4_text decoding step stays stock (Gemma 4's shared-KV layers)",
               "gemma4_text per-layer input embeddings: the gate and projection are the "
               "model's own (their LoRA Linears fused), the lookup and norm stock",
               "gemma4_text attention: q, k, v through lora_qkv where a layer has all three; a "
               "shared-KV layer projects q alone and rotates it with the model's own rope, an "
               "attention_k_eq_v layer runs q_proj and k_proj as fused LoRA Linears"),
        mixers=(("Gemma4TextExperts", "MoE experts"), ("Gemma4TextRouter", "MoE router")),
    ),
    "olmo3": ArchSpec(
        "Olmo3", _M.format("olmo3"), qk_norm="whole", sliding="attr", norm="fp32",
        parts=TRAINING_PARTS, stock=("olmo3 decoding step stays stock (post-norm layers)",),
    ),
    "qwen3_moe": ArchSpec(
        "Qwen3Moe", _M.format("qwen3_moe"), qk_norm=True, sliding="attr", parts=TRAINING_PARTS,
        stock=("qwen3_moe decoding step stays stock (MoE layers)",),
        mixers=(("Qwen3MoeSparseMoeBlock", "MoE block (router and experts)"),),
    ),
    "gpt_oss": ArchSpec(
        "GptOss", _M.format("gpt_oss"), sliding="attr", norm="fp32", sinks=True, half_rope=True,
        parts=TRAINING_PARTS - {"mlp"},
        stock=("gpt_oss decoding step stays stock (MoE layers, attention sinks)",
               "gpt_oss attention: lora_qkv (biases included) and rope fused; the attention "
               "itself is the model's own interface (its per-head sinks are in no fast kernel)",
               "gpt_oss mlp: every layer is a MoE block (no dense MLP to fuse)"),
        mixers=(("GptOssMLP", "MoE block (router and clamped-SwiGLU experts)"),),
    ),
}  # fmt: skip
REGISTRY |= REGISTRY_2026
GENERIC_NOTE = (
    "architecture {arch!r} has no fused attention/MLP/norm/loss fast path (registry: "
    "{known}); its LoRA Linear layers are fused, the rest runs stock transformers"
)
