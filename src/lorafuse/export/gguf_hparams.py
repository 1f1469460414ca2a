"""Metadata keys every text family writes: what llama.cpp's converter writes from the HF config
(``TextModel.set_gguf_parameters``), and the helpers the per-family keys and checks share.

Some keys the llama.cpp we test against reads are newer than the installed ``gguf`` package
(``attention.recurrent_layers``); they are written under their literal names (``raw_key``).
"""

from __future__ import annotations

import math

import gguf

from lorafuse.export.gguf_vocab import GGUFExportError


def rope_params(config: dict, layer_type: str | None = None) -> dict:
    """transformers 5 keeps rope type/theta in ``rope_parameters`` (per layer type for Gemma 3,
    OLMo 3, Gemma 4: ``layer_type``, default the full-attention layers'), older versions in
    ``rope_scaling`` + ``rope_theta``."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if layer_type and isinstance(rope.get(layer_type), dict):
        rope = dict(rope[layer_type])
    elif isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def arch_name(config: dict) -> str:
    return (config.get("architectures") or [config.get("model_type")])[0]


def rope_default_only(config: dict, allowed=("default",), layer_type: str | None = None) -> None:
    rope_type = rope_params(config, layer_type)["rope_type"]
    if rope_type not in allowed:
        raise GGUFExportError(
            f"rope type {rope_type!r} is not supported for {arch_name(config)} GGUF export; "
            f"supported: {list(allowed)}"
        )


def pattern(config: dict, want: list, what: str) -> None:
    """llama.cpp hard-codes some per-layer patterns; a config with another one would run
    differently there, so it is refused."""
    got = config.get(what) or want
    if list(got) != want:
        raise GGUFExportError(f"{what} {got} differs from the pattern llama.cpp assumes ({want})")


def refuse(config: dict, **conditions: str) -> None:
    """Raise for the first ``name=reason`` whose config value is set (truthy)."""
    for key, reason in conditions.items():
        if config.get(key):
            raise GGUFExportError(
                f"{arch_name(config)} with {key}={config[key]!r}: {reason}; not exportable to GGUF"
            )


def raw_key(w: gguf.GGUFWriter, key: str, value) -> None:
    """``{arch}.key`` = value, for keys the installed gguf package has no writer for."""
    name = f"{w.arch}.{key}"
    if isinstance(value, list):
        w.add_array(name, value)
    elif isinstance(value, bool):
        w.add_bool(name, value)
    elif isinstance(value, int):
        w.add_uint32(name, value)
    else:
        w.add_float32(name, float(value))


def keys_text(w: gguf.GGUFWriter, c: dict) -> None:
    """The keys ``TextModel.set_gguf_parameters`` writes from a text config."""
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c.get("max_position_embeddings", 2048))
    w.add_embedding_length(c["hidden_size"])
    if c.get("intermediate_size"):
        w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    kv = c.get("num_key_value_heads")
    w.add_head_count_kv(kv if kv is not None else c["num_attention_heads"])
    rope = rope_params(c)
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):  # fmt: skip
            if rope.get(key) is not None:
                add(float(rope[key]))
        # transformers scales cos/sin by attention_factor (default 0.1 ln(factor) + 1);
        # llama.cpp by that default times rope.scaling.attn_factor
        given = rope.get("attention_factor", rope.get("attn_factor"))
        default = 0.1 * math.log(rope["factor"]) + 1.0
        if given is not None and abs(given / default - 1.0) > 1e-6:
            raw_key(w, "rope.scaling.attn_factor", float(given / default))
    elif rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    swa = (c.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(swa, dict) and swa.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(float(swa["rope_theta"]))
    eps = c.get("rms_norm_eps", c.get("norm_eps"))
    if eps is not None:
        w.add_layer_norm_rms_eps(float(eps))
    experts = c.get("num_local_experts") or c.get("num_experts")
    if experts:
        w.add_expert_count(experts)
    used = c.get("num_experts_per_tok")
    if experts and used:
        w.add_expert_used_count(used)
    if c.get("head_dim"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
