"""Granite 4 hybrid (``GraniteMoeHybridForCausalLM`` -> ``granitehybrid``) as llama.cpp's converter
writes it: Mamba2 layers interleaved with attention layers, a routed MoE plus a shared MLP in
every layer, Granite's multipliers (embedding, residual, attention, logits).

llama.cpp tells the layer kinds apart by ``attention.head_count_kv`` per layer (0: a Mamba2
layer). Mamba2: ``A = -exp(A_log)`` and ``D`` as (heads, 1), the conv kernel (C, 1, K) squeezed
to (C, K), ``dt_bias`` as ``ssm_dt.bias``, the gated norm's weight as (groups, d_inner / groups).
The experts' fused ``input_linear`` (E, 2 x I, hidden) and the shared MLP's are split into gate
(first half) and up. q/k rows are permuted for llama.cpp's "norm" rope, which runs only where the
config asks for rope (``position_embedding_type``; Granite 4.0-H has none: ``rope.scaling.finetuned``
false is llama.cpp's switch).
"""

from __future__ import annotations

import math

import gguf

from lorafuse.export.gguf_hparams import arch_name, head_dim, keys_text, rope_default_only
from lorafuse.export.gguf_layout import Family, Item, mapped_items, permute_rows, tn
from lorafuse.export.gguf_vocab import GGUFExportError

A, T = gguf.MODEL_ARCH, gguf.MODEL_TENSOR


def _attention(c: dict) -> list[bool]:
    # transformers 5 normalises "attention" / "mamba" to "full_attention" / "linear_attention"
    return [t in ("attention", "full_attention") for t in c["layer_types"]]


def _keys(w: gguf.GGUFWriter, c: dict) -> None:
    kv = [c["num_key_value_heads"] if a else 0 for a in _attention(c)]
    keys_text(w, {**c, "num_key_value_heads": kv})
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(head_dim(c))
    for key, add in (("attention_multiplier", w.add_attention_scale),
                     ("embedding_multiplier", w.add_embedding_scale),
                     ("residual_multiplier", w.add_residual_scale),
                     ("logits_scaling", w.add_logit_scale)):  # fmt: skip
        if c.get(key):
            add(float(c[key]))
    if c.get("shared_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_intermediate_size"])
    w.add_ssm_conv_kernel(c["mamba_d_conv"])
    w.add_ssm_state_size(c["mamba_d_state"])
    w.add_ssm_group_count(c["mamba_n_groups"])
    w.add_ssm_inner_size(c["mamba_expand"] * c["hidden_size"])
    w.add_ssm_time_step_rank(c["mamba_n_heads"])
    w.add_rope_scaling_finetuned(c.get("position_embedding_type") == "rope")


def _check(c: dict) -> None:
    rope_default_only(c)
    name = arch_name(c)
    if set(c["layer_types"]) - {"attention", "full_attention", "mamba", "linear_attention"}:
        raise GGUFExportError(f"layer_types {c['layer_types']}: unknown layer type")
    if not c.get("num_local_experts"):
        raise GGUFExportError(f"{name} without experts: llama.cpp's converter writes it as another arch (granite); not supported here")  # fmt: skip
    if c["mamba_expand"] != 2:
        raise GGUFExportError(f"mamba_expand {c['mamba_expand']}: llama.cpp's granitehybrid supports 2 only")  # fmt: skip
    if c.get("mamba_proj_bias") or not c.get("mamba_conv_bias", True):
        raise GGUFExportError(f"{name} mamba_proj_bias / no mamba_conv_bias: llama.cpp's Mamba2 has a conv bias and no projection bias")  # fmt: skip
    if c["mamba_expand"] * c["hidden_size"] != c["mamba_n_heads"] * c["mamba_d_head"]:
        raise GGUFExportError(f"{name}: mamba_n_heads x mamba_d_head must equal mamba_expand x hidden_size")  # fmt: skip
    # transformers writes infinity in config.json as {"__float__": "Infinity"}
    low, high = (_float(v) for v in (c.get("time_step_limit") or (0.0, math.inf))[:2])
    if low != 0.0 or high != math.inf:
        raise GGUFExportError(f"time_step_limit {c['time_step_limit']}: llama.cpp does not clamp Mamba2's dt")  # fmt: skip
    if c.get("hidden_act", "silu") != "silu":
        raise GGUFExportError(f"hidden_act {c['hidden_act']!r}: llama.cpp runs {name} with SiLU")


def _float(v) -> float:
    return float(v["__float__"] if isinstance(v, dict) else v)


def _items(fam: Family, keys: list[str], c: dict) -> list[Item]:
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    groups, inner = c["mamba_n_groups"], c["mamba_expand"] * c["hidden_size"]

    def one(fn):
        return lambda key, gname: [Item(gname, (key,), fn)]

    def halves(gate: T, up: T):
        def split(key, _):
            return [Item(tn(gate, key), (key,), lambda w: w.chunk(2, dim=-2)[0]),
                    Item(tn(up, key), (key,), lambda w: w.chunk(2, dim=-2)[1])]  # fmt: skip

        return split

    rules = [
        (r"mamba\.A_log$", one(lambda w: -w.exp().unsqueeze(-1))),
        (r"mamba\.D$", one(lambda w: w.unsqueeze(-1))),
        (r"mamba\.conv1d\.weight$", one(lambda w: w.squeeze(1))),
        (r"mamba\.norm\.weight$", one(lambda w: w.reshape(groups, inner // groups))),
        (r"self_attn\.q_proj\.weight$", one(lambda w: permute_rows(w, heads))),
        (r"self_attn\.k_proj\.weight$", one(lambda w: permute_rows(w, kv))),
        (r"block_sparse_moe\.input_linear\.weight$", halves(T.FFN_GATE_EXP, T.FFN_UP_EXP)),
        (r"block_sparse_moe\.output_linear\.weight$", lambda key, _: [Item(tn(T.FFN_DOWN_EXP, key), (key,))]),  # fmt: skip
        (r"shared_mlp\.input_linear\.weight$", halves(T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP)),
        (r"shared_mlp\.output_linear\.weight$", lambda key, _: [Item(tn(T.FFN_DOWN_SHEXP, key), (key,))]),  # fmt: skip
    ]  # fmt: skip
    return mapped_items(fam, keys, c, rules, rename=lambda k: k.replace(".dt_bias", ".dt_proj.bias"))  # fmt: skip


FAMILIES = {"GraniteMoeHybridForCausalLM": Family(A.GRANITE_HYBRID, _keys, _check, _items)}
