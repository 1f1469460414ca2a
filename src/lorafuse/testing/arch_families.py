"""Tiny random models of each architecture lorafuse exports, from the architecture's own
transformers config: what the per-family GGUF and chat tests run.

The configs make each family's special parts matter: Llama 3 rope scaling with a small
``original_max_position_embeddings``, q/k/v bias (Qwen2), q/k norms and head_dim != hidden/heads
(Qwen3, Gemma), soft-capping and sliding windows of 16 tokens (Gemma 2/3), Gemma 3's
per-layer-type rope theta (7 layers: one global layer after six local ones), Phi's fused qkv /
gate_up, SmolLM3's no-rope layers (every 4th layer) and 2048 positions (its chat template's system
block alone is ~1,100 tokens of the tiny chat tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)  # fmt: skip
ATTN, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
# arch -> (config class name, config overrides, LoRA targets)
ARCH_CASES = {
    "LlamaForCausalLM": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), ATTN + MLP),
    "MistralForCausalLM": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=None), ATTN + MLP),
    "SmolLM3ForCausalLM": ("SmolLM3Config", dict(num_hidden_layers=4, max_position_embeddings=2048),
        ATTN + MLP),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(num_hidden_layers=2, tie_word_embeddings=True), ATTN + MLP),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(num_hidden_layers=2, head_dim=32), ATTN + MLP),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(num_hidden_layers=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0), ATTN + MLP),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(num_hidden_layers=7, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=16), ATTN + MLP),
    "Phi3ForCausalLM": ("Phi3Config", dict(num_hidden_layers=2, sliding_window=None, tie_word_embeddings=False,
        ), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}  # fmt: skip
# architectures only the decode engine's tests build (not exported): arch -> (config, overrides)
MORE_CASES = {
    "GemmaForCausalLM": ("GemmaConfig", dict(num_hidden_layers=2, head_dim=32)),
    "Olmo2ForCausalLM": ("Olmo2Config", dict(num_hidden_layers=2)),
    "Olmo3ForCausalLM": ("Olmo3Config", dict(num_hidden_layers=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    "GraniteForCausalLM": ("GraniteConfig", dict(num_hidden_layers=2, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=8.0)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(num_hidden_layers=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32)),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=8,
        num_experts_per_tok=2, intermediate_size=32, sliding_window=16)),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(num_hidden_layers=2, num_experts=8,
        num_experts_per_tok=2, intermediate_size=32)),
    "Lfm2ForCausalLM": ("Lfm2Config", dict(num_hidden_layers=4, conv_L_cache=3,
        block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention", "conv", "conv"])),
    "Lfm2MoeForCausalLM": ("Lfm2MoeConfig", dict(num_hidden_layers=3, num_dense_layers=1,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, conv_L_cache=3,
        routed_scaling_factor=2.5, layer_types=["conv", "full_attention", "conv"])),
}  # fmt: skip


def build_arch_model(arch: str, tok, overrides: dict | None = None):
    """A tiny random fp32 ``arch`` model (``ARCH_CASES[arch]``'s or ``MORE_CASES[arch]``'s config,
    or ``overrides`` in place of its overrides) for tokenizer ``tok`` (its vocab size, BOS / EOS /
    pad ids)."""
    import transformers

    cls_name, case = ARCH_CASES[arch][:2] if arch in ARCH_CASES else MORE_CASES[arch]
    overrides = case if overrides is None else overrides
    cfg = getattr(transformers, cls_name)(**{**SMALL, **overrides}, vocab_size=len(tok),
                                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.pad_token_id)  # fmt: skip
    cfg.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).float().eval()
    with torch.no_grad():  # decisive logits (random init is near-uniform), as save_tiny_model
        for name, p in model.named_parameters():
            if (p.dim() == 2 and "embed" not in name) or "experts" in name:  # 3-D MoE experts
                p.mul_(8.0)
            elif p.dim() == 1:
                p.normal_(0.0, 0.5) if "norm" in name else p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():  # LFM2-MoE's bias on the routing scores (zeros)
            if name.endswith("expert_bias"):
                b.normal_(0.0, 0.2)
    return model


def save_arch_model(arch: str, path: str | os.PathLike, tok, overrides: dict | None = None):
    """:func:`build_arch_model`, written with ``tok`` as a stock HF dir at ``path``; returns it."""
    model = build_arch_model(arch, tok, overrides)
    model.save_pretrained(Path(path))
    tok.save_pretrained(Path(path))
    return model
