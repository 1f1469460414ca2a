"""Tiny random models of the late-2026 families, from each architecture's own transformers config:
the hybrids (Qwen3.5 and Qwen3-Next: Gated DeltaNet + gated attention 3:1; LFM2: short
convolutions + attention; Granite 4: Mamba2 + attention), the new dense layouts (Gemma 4 text,
OLMo 3) and the mixtures of experts (Qwen3-MoE, Qwen3.5-MoE, gpt-oss, LFM2-MoE; Qwen3-Next and
Granite 4 carry experts too).

Sizes make each special part matter at a few dozen tokens: linear-attention heads with GQA-like
repeats (value heads = 2 x key heads), conv kernels of 3-4, Mamba2 chunks of 8 tokens (so a
32-token row crosses chunk boundaries), 4 experts with top-2 routing, sliding windows of 16.
``FAMILY_CASES[arch] = (config class, overrides, kind, LoRA target modules)``; ``kind`` is
``hybrid`` (a token mixer that carries state along the sequence), ``dense`` or ``moe``; the
targets are the family's ``nn.Linear`` names (routed experts are 3-D parameters, not Linears:
PEFT reaches them through ``target_parameters``; shared experts are Linears).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)  # fmt: skip
ATTN, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
_GDN = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"])  # fmt: skip
_GDN_PROJ = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
_NEXT_PROJ = ["in_proj_qkvz", "in_proj_ba", "out_proj"]  # Qwen3-Next's fused projections
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=8)  # fmt: skip

FAMILY_CASES = {
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, **_GDN), "hybrid",
        ATTN + MLP + _GDN_PROJ),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", dict(num_hidden_layers=4, **_GDN, **_EXPERTS,
        shared_expert_intermediate_size=32), "hybrid", ATTN + MLP + _NEXT_PROJ),
    "Lfm2ForCausalLM": ("Lfm2Config", dict(num_hidden_layers=4, conv_L_cache=3,
        block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention", "conv", "conv"]),
        "hybrid", ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"]),
    "GraniteMoeHybridForCausalLM": ("GraniteMoeHybridConfig", dict(num_hidden_layers=4, **_MAMBA,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
        logits_scaling=2.0, layer_types=["linear_attention", "attention", "linear_attention",
        "linear_attention"]), "hybrid", ATTN + ["in_proj", "out_proj", "input_linear",
        "output_linear"]),
    "Gemma4ForCausalLM": ("Gemma4TextConfig", dict(num_hidden_layers=4, head_dim=16,
        sliding_window=16, hidden_size_per_layer_input=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"]), "dense", ATTN + MLP),
    "Olmo3ForCausalLM": ("Olmo3Config", dict(num_hidden_layers=4, sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"]), "dense", ATTN + MLP),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(num_hidden_layers=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "moe", ATTN),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=4, **_GDN, **_EXPERTS,
        shared_expert_intermediate_size=32), "moe", ATTN + MLP + _GDN_PROJ),
    "GptOssForCausalLM": ("GptOssConfig", dict(num_hidden_layers=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={"rope_type": "yarn",
        "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}), "moe", ATTN),
    "Lfm2MoeForCausalLM": ("Lfm2MoeConfig", dict(num_hidden_layers=3, num_dense_layers=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        layer_types=["conv", "full_attention", "conv"]), "moe",
        ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"]),
}  # fmt: skip


SCALE = 8.0  # Linear weights x 8: logits spread over several units at the defaults' init


def family_config(arch: str, tok=None, **overrides):
    """The tiny config of ``arch`` (``FAMILY_CASES``), with ``overrides`` applied last; with a
    tokenizer ``tok``, its vocab size and BOS / EOS / pad ids (else a 256-token vocab)."""
    import transformers

    cls_name, case, _, _ = FAMILY_CASES[arch]
    ids = dict(vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if tok is not None:
        ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    if "Gemma4" in cls_name:
        ids["vocab_size_per_layer_input"] = ids["vocab_size"]
    cfg = getattr(transformers, cls_name)(**{**SMALL, **case, **ids, **overrides})
    cfg.architectures = [arch]
    return cfg


def build_family_model(arch: str, tok=None, seed: int = 0, **overrides):
    """A tiny random fp32 ``arch`` model in eval mode. Linear weights are scaled up so greedy
    tokens are decisive (random init gives near-uniform logits); every other tensor keeps
    transformers' own init (recurrent decay rates, conv kernels, expert tensors)."""
    import transformers

    cfg = family_config(arch, tok, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(SCALE)
    return model


def save_family_model(arch: str, path: str | os.PathLike, tok, **overrides):
    """:func:`build_family_model` with ``tok``, written as a stock HF dir at ``path``; returns it."""
    model = build_family_model(arch, tok, **overrides)
    model.save_pretrained(Path(path))
    tok.save_pretrained(Path(path))
    return model


def build_qwen3_5_vl_model(seed: int = 0):
    """Qwen3.5's vision-language model (``model_type`` qwen3_5, as the published small models
    ship) with the tiny Qwen3.5 text config and a one-block vision tower, fp32, eval mode; its
    language decoder's Linear weights scaled as :func:`build_family_model`'s."""
    import transformers

    text = family_config("Qwen3_5ForCausalLM").to_dict()
    text.pop("architectures", None)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2)  # fmt: skip
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for m in model.model.language_model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(SCALE)
    return model
