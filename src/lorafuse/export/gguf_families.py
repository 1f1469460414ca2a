"""Per-family GGUF layout: what llama.cpp's ``convert_hf_to_gguf.py`` writes for each HF architecture.

One ``Family`` (``gguf_layout``) per Hugging Face architecture. The families here are written
tensor for tensor under gguf's names (``plain_items``): q/k rows permuted for llama.cpp's "norm"
rope (llama, smollm3; the NEOX-rope archs qwen2/qwen3/gemma/phi3 keep HF's rotate-half rows),
Gemma's ``(1 + w)`` RMSNorm written as ``w + 1`` for every ``*norm.weight``, Llama 3's rope
scaling as a ``rope_freqs`` tensor. The late-2026 families (hybrids, MoE, Gemma 4, OLMo 3) have
modules of their own (``gguf_qwen35``...), registered here. ``check`` refuses configs llama.cpp
would run differently from transformers (before anything is written).
"""

from __future__ import annotations

import math
import warnings

import gguf
import torch

from lorafuse.export.gguf_gemma4 import FAMILIES as GEMMA4_FAMILIES
from lorafuse.export.gguf_gptoss import FAMILIES as GPTOSS_FAMILIES
from lorafuse.export.gguf_granite import FAMILIES as GRANITE_FAMILIES
from lorafuse.export.gguf_hparams import (
    head_dim,
    keys_text,
    pattern,
    rope_default_only,
    rope_params,
)
from lorafuse.export.gguf_layout import Family, Item, mapped_items, permute_rows
from lorafuse.export.gguf_lfm2 import FAMILIES as LFM2_FAMILIES
from lorafuse.export.gguf_qwen35 import FAMILIES as QWEN35_FAMILIES
from lorafuse.export.gguf_vocab import GGUFExportError

A = gguf.MODEL_ARCH


def llama3_rope_factors(config: dict) -> torch.Tensor:
    """The ``rope_freqs`` tensor llama.cpp multiplies each rope wavelength by (as its converter
    computes it from the ``llama3`` rope parameters); (head_dim / 2,) f32."""
    rope, dim = rope_params(config), head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = (
        rope.get("factor", 8.0),
        rope.get("low_freq_factor", 1.0),
        rope.get("high_freq_factor", 4.0),
    )
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _check_llama(config: dict) -> None:
    rope_default_only(config, ("default", "llama3"))
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise GGUFExportError("attention_bias / mlp_bias Llama variants are not supported")


def _warn_full_attention(config: dict, arch: str) -> None:
    """Warn where llama.cpp runs ``arch`` with full attention but the config has a window."""
    window = config.get("sliding_window")
    if window and window < config.get("max_position_embeddings", 0):
        warnings.warn(
            f"sliding_window {window}: llama.cpp runs {arch} with full attention, so prompts "
            f"longer than {window} tokens differ from transformers",
            stacklevel=4,
        )


def _check_mistral(config: dict) -> None:
    _check_llama(config)
    # llama.cpp's "llama" arch (the converter writes Mistral as it) has no sliding window
    _warn_full_attention(config, "Mistral")


def _check_qwen(config: dict) -> None:
    rope_default_only(config)
    if config.get("use_sliding_window"):
        raise GGUFExportError("use_sliding_window Qwen configs are not supported by llama.cpp")


def _check_smollm3(config: dict) -> None:
    _check_llama(config)
    n = config["num_hidden_layers"]
    # llama.cpp's smollm3 skips rope on every 4th layer (n_no_rope_layer_step = 4)
    pattern(config, [int((i + 1) % 4 != 0) for i in range(n)], "no_rope_layers")
    if config.get("use_sliding_window"):
        raise GGUFExportError("use_sliding_window SmolLM3 configs are not supported by llama.cpp")


def _check_gemma(config: dict, period: int) -> None:
    n = config["num_hidden_layers"]
    want = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    pattern(config, want, "layer_types")
    rope = rope_params(config, "sliding_attention" if period == 6 else None)
    if rope["rope_type"] != "default" or (period == 6 and rope["rope_theta"] != 10000.0):
        raise GGUFExportError(
            f"Gemma sliding-layer rope {rope} differs from llama.cpp's (default, theta 10000)"
        )
    if period == 6:
        rope_default_only({**config, "rope_parameters": rope_params(config, "full_attention")}, ("default", "linear"))  # fmt: skip
    # llama.cpp scales q by 1/sqrt(hidden / heads) for the 27B models, which it knows by their
    # layer count (Gemma 2: 46, Gemma 3: 62), else by 1/sqrt(head_dim); no GGUF key sets it
    big = n == (46 if period == 2 else 62)
    want = config["hidden_size"] / config["num_attention_heads"] if big else head_dim(config)
    scalar = config.get("query_pre_attn_scalar", head_dim(config))
    if scalar != want:
        what = "hidden_size / heads (its 27B layer count)" if big else "head_dim"
        raise GGUFExportError(
            f"query_pre_attn_scalar {scalar}: llama.cpp scales queries by {what} = {want:g} for a "
            f"{n}-layer {config['architectures'][0]}"
        )


def _check_phi3(config: dict) -> None:
    rope_default_only(config)  # longrope needs rope_factors_long/short tensors
    _warn_full_attention(config, "phi3")  # llama.cpp: "Phi SWA is currently disabled"


def _keys_common(w: gguf.GGUFWriter, c: dict) -> None:
    heads = c["num_attention_heads"]
    w.add_context_length(c.get("max_position_embeddings", 2048))
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(c.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    w.add_rope_freq_base(float(rope_params(c, "full_attention")["rope_theta"]))
    if head_dim(c) * heads != c["hidden_size"] or c.get("head_dim"):
        w.add_key_length(head_dim(c))
        w.add_value_length(head_dim(c))


def _keys_llama(w: gguf.GGUFWriter, c: dict) -> None:
    _keys_common(w, c)
    w.add_rope_dimension_count(head_dim(c))
    w.add_vocab_size(c["vocab_size"])


def _keys_gemma2(w: gguf.GGUFWriter, c: dict) -> None:
    _keys_common(w, c)
    w.add_attn_logit_softcapping(float(c["attn_logit_softcapping"]))
    w.add_final_logit_softcapping(float(c["final_logit_softcapping"]))
    w.add_sliding_window(c["sliding_window"])


def _keys_gemma3(w: gguf.GGUFWriter, c: dict) -> None:
    _keys_common(w, c)
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(c["final_logit_softcapping"]))
    w.add_sliding_window(c["sliding_window"])
    rope = rope_params(c, "full_attention")
    if rope["rope_type"] == "linear":  # global layers only, as the converter writes it
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))


def _keys_phi3(w: gguf.GGUFWriter, c: dict) -> None:
    _keys_common(w, c)
    w.add_rope_dimension_count(int(c.get("partial_rotary_factor", 1.0) * head_dim(c)))
    w.add_sliding_window(c.get("sliding_window") or c.get("max_position_embeddings", 4096))


def _check_olmo3(config: dict) -> None:
    # llama.cpp's olmo2 rotates sliding layers unscaled, full ones with the file's rope scaling,
    # as transformers' per-layer-type rope does
    rope_default_only(config, ("default", "yarn"))
    rope_default_only(config, layer_type="sliding_attention")
    _check_attention_bias(config)


def _check_attention_bias(config: dict) -> None:
    if config.get("attention_bias"):
        raise GGUFExportError(f"{config['architectures'][0]} with attention_bias: llama.cpp's graph has no q/k/v/o bias")  # fmt: skip


def _keys_olmo3(w: gguf.GGUFWriter, c: dict) -> None:
    keys_text(w, c)
    if c.get("sliding_window"):
        w.add_sliding_window(c["sliding_window"])
        n = c["num_hidden_layers"]
        types = c.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]  # fmt: skip
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])


def _check_qwen3moe(config: dict) -> None:
    _check_qwen(config)
    _check_attention_bias(config)
    if not config.get("norm_topk_prob"):
        raise GGUFExportError(
            "Qwen3-MoE with norm_topk_prob false: llama.cpp's qwen3moe always renormalises the "
            "top-k routing weights, so it would run this model differently"
        )
    pattern(config, [], "mlp_only_layers")  # llama.cpp makes every layer sparse
    if config.get("decoder_sparse_step", 1) != 1:
        raise GGUFExportError(f"decoder_sparse_step {config['decoder_sparse_step']}: llama.cpp makes every layer sparse")  # fmt: skip


def _keys_qwen3moe(w: gguf.GGUFWriter, c: dict) -> None:
    keys_text(w, c)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])


def plain_items(fam: Family, keys: list[str], config: dict) -> list[Item]:
    """Each tensor as stored, under gguf's name; q/k rows permuted for the "norm" rope, norms
    shifted by ``norm_shift``, Llama 3's rope scaling as ``rope_freqs``."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads

    def one(key: str, gname: str | None) -> list[Item]:
        if gname is None:
            raise GGUFExportError(f"tensor {key} has no GGUF {fam.name} name")
        if fam.norm_shift and key.endswith("norm.weight"):
            return [Item(gname, (key,), lambda w: w.float() + fam.norm_shift)]
        if fam.permute_qk and gname.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if gname.endswith("attn_q.weight") else kv_heads
            return [Item(gname, (key,), lambda w: permute_rows(w, n))]
        return [Item(gname, (key,))]

    items = []
    if rope_params(config)["rope_type"] == "llama3":
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        items.append(Item(name, (), lambda: llama3_rope_factors(config)))
    return items + mapped_items(fam, keys, config, [(".", one)])


def _plain(arch, keys, check, **kw) -> Family:
    return Family(arch, keys, check, plain_items, **kw)


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": _plain(A.LLAMA, _keys_llama, _check_llama, permute_qk=True),
    "MistralForCausalLM": _plain(A.LLAMA, _keys_llama, _check_mistral, permute_qk=True),
    "SmolLM3ForCausalLM": _plain(A.SMOLLM3, _keys_llama, _check_smollm3, permute_qk=True),
    "Qwen2ForCausalLM": _plain(A.QWEN2, _keys_common, _check_qwen),
    "Qwen3ForCausalLM": _plain(A.QWEN3, _keys_common, _check_qwen),
    "Gemma2ForCausalLM": _plain(
        A.GEMMA2, _keys_gemma2, lambda c: _check_gemma(c, 2), norm_shift=1.0, tied_always=True
    ),  # fmt: skip
    "Gemma3ForCausalLM": _plain(
        A.GEMMA3, _keys_gemma3, lambda c: _check_gemma(c, 6), norm_shift=1.0, tied_always=True
    ),  # fmt: skip
    "Phi3ForCausalLM": _plain(A.PHI3, _keys_phi3, _check_phi3),
    # OLMo 3: llama.cpp's converter writes it as olmo2 with a sliding-window pattern
    "Olmo3ForCausalLM": _plain(A.OLMO2, _keys_olmo3, _check_olmo3),
    "Qwen3MoeForCausalLM": _plain(A.QWEN3MOE, _keys_qwen3moe, _check_qwen3moe),
}


for more in (QWEN35_FAMILIES, LFM2_FAMILIES, GRANITE_FAMILIES, GEMMA4_FAMILIES, GPTOSS_FAMILIES):
    FAMILIES.update(more)


def family(config: dict) -> Family:
    archs = config.get("architectures") or []
    if "vision_config" in config:  # refused, never written as a text-only file
        raise GGUFExportError(
            f"{archs[0] if archs else config.get('model_type')} is a vision-language model: its "
            "GGUF export (the language model plus the mmproj projector file llama.cpp's "
            "multimodal tool loads) is not implemented; export --format safetensors instead"
        )
    if not archs or archs[0] not in FAMILIES:
        raise GGUFExportError(
            f"architecture {archs or config.get('model_type')} not supported for GGUF export; "
            f"supported: {sorted(FAMILIES)}"
        )
    return FAMILIES[archs[0]]
