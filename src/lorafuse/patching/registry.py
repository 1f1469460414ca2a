"""The registry of per-architecture fast paths: :data:`REGISTRY` maps ``config.model_type`` to an
:class:`ArchSpec`, which says where the transformers classes live whose *instances* get a fused
forward (classes are matched exactly, so a subclass with its own forward is never patched by
mistake), how the architecture's attention differs from Llama's, and which fast paths (``parts``)
fit it; ``stock`` says why each missing one runs stock transformers.

llama, mistral, qwen2, qwen3, smollm3 in full; phi3 (norm, attention on ``qkv_proj``'s row blocks,
MLP on ``gate_up_proj``'s halves, loss), gemma2 and gemma3_text ((1 + w) norm on fp32 weights,
GeGLU MLP, loss with final-logit soft-capping) in part; the language decoders of idefics3,
qwen2_vl and qwen2_5_vl. The forwards are :mod:`lorafuse.patching.llama_forwards`; applying the
registry to a model is :func:`lorafuse.patching.llama.apply_fast_paths`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

ALL_PARTS = frozenset(("rms_norm", "mlp", "attention", "loss", "decode_step"))


@dataclass(frozen=True)
class ArchSpec:
    """Where an architecture's classes live, how its attention differs from Llama's, and which
    fast paths fit it (``parts``; ``stock`` says why each missing one runs stock transformers)."""

    prefix: str  # class-name prefix: "Llama" -> LlamaRMSNorm, LlamaAttention, ...
    module: str  # the transformers modeling module
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    sliding: str | None = (
        None  # "config": config.sliding_window (Mistral); "attr": self.sliding_window
    )
    rope_attr: bool = False  # SmolLM3: RoPE only where self.use_rope (NoPE layers)
    gate_up: bool = False  # Phi-3: one gate_up_proj (gate rows first) instead of gate/up
    fused_qkv: bool = False  # Phi-3: one qkv_proj (q rows, then k, then v) instead of q/k/v
    norm_offset: bool = False  # Gemma: RMSNorm scales by (1 + w), in fp32, rounded once
    attn_softcap: bool = False  # Gemma 2: attention logits soft-capped (the model's interface)
    parts: frozenset = ALL_PARTS
    stock: tuple[str, ...] = ()  # one line per fast path left out, with the reason
    mlp: str | None = None  # the MLP class when not <prefix>MLP (Qwen2-VL's decoder: Qwen2MLP)
    head: tuple[str, str] | None = (
        None  # (module, class) with the loss when not <prefix>ForCausalLM
    )
    notes: tuple[str, ...] = ()  # facts the report states (how a rope variant is handled)

    def cls(self, suffix: str):
        if suffix == "MLP" and self.mlp:
            suffix, name = "", self.mlp
        elif suffix == "ForCausalLM" and self.head:
            return getattr(importlib.import_module(self.head[0]), self.head[1], None)
        else:
            name = self.prefix + suffix
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
        parts=ALL_PARTS - {"decode_step"},
        stock=_PHI3_STOCK,
    ),
    "gemma2": ArchSpec(
        "Gemma2",
        "transformers.models.gemma2.modeling_gemma2",
        sliding="attr",
        norm_offset=True,
        attn_softcap=True,
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
        norm_offset=True,
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
        parts=_VLM_PARTS, stock=(_VLM_STOCK[0].format(p="qwen2_vl"),), mlp="Qwen2MLP",
        head=("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLForConditionalGeneration"),
        notes=(_MROPE[0].format(p="qwen2_vl"),),
    ),
    "qwen2_5_vl": ArchSpec(
        "Qwen2_5_VL", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", sliding="attr",
        parts=_VLM_PARTS, stock=(_VLM_STOCK[0].format(p="qwen2_5_vl"),), mlp="Qwen2MLP",
        head=(
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
            "Qwen2_5_VLForConditionalGeneration",
        ),
        notes=(_MROPE[0].format(p="qwen2_5_vl"),),
    ),
}  # fmt: skip
GENERIC_NOTE = (
    "architecture {arch!r} has no fused attention/MLP/norm/loss fast path (registry: "
    "{known}); its LoRA Linear layers are fused, the rest runs stock transformers"
)
