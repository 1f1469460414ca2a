"""LFM2 (``lfm2``) and LFM2-MoE (``lfm2moe``) as llama.cpp's converter writes them: gated short
convolutions (``conv``) interleaved with full-attention layers.

llama.cpp tells the layer kinds apart by ``attention.head_count_kv`` per layer (0: a conv layer).
The depthwise conv kernel (C, 1, L) is squeezed to (C, L) (``shortconv.conv``, f32);
``embedding_norm``, which LFM2 applies after the last layer, is llama.cpp's ``token_embd_norm``.
LFM2-MoE: the first ``num_dense_layers`` keep a dense MLP, the rest route with sigmoid scores
plus a per-expert bias (``exp_probs_b``), top-k weights renormalised; its experts are stacked per
projection (w1 gate, w3 up, w2 down).
"""

from __future__ import annotations

import gguf

from lorafuse.export.gguf_hparams import arch_name, keys_text, rope_default_only
from lorafuse.export.gguf_layout import Family, Item, mapped_items
from lorafuse.export.gguf_vocab import GGUFExportError

A = gguf.MODEL_ARCH


def _ff_length(c: dict) -> int:
    """The MLP width: ``block_auto_adjust_ff_dim`` shrinks it as LFM2's blocks do."""
    ff = c.get("block_ff_dim") or c["intermediate_size"]
    if c.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if c.get("block_ffn_dim_multiplier") is not None:
            ff = int(c["block_ffn_dim_multiplier"] * ff)
        multiple = c["block_multiple_of"]
        ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def _keys(w: gguf.GGUFWriter, c: dict, moe: bool = False) -> None:
    kv = [c["num_key_value_heads"] if t != "conv" else 0 for t in c["layer_types"]]
    ff = c["intermediate_size"] if moe else _ff_length(c)
    keys_text(w, {**c, "num_key_value_heads": kv, "intermediate_size": ff})
    w.add_vocab_size(c["vocab_size"])
    w.add_shortconv_l_cache(c["conv_L_cache"])


def _keys_moe(w: gguf.GGUFWriter, c: dict) -> None:
    _keys(w, c, moe=True)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_leading_dense_block_count(c["num_dense_layers"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _check(c: dict) -> None:
    rope_default_only(c)
    if set(c["layer_types"]) - {"conv", "full_attention"}:
        raise GGUFExportError(f"layer_types {c['layer_types']}: unknown layer type")
    if c.get("conv_bias"):
        raise GGUFExportError(f"{arch_name(c)} with conv_bias: llama.cpp's short conv has no bias")


def _check_moe(c: dict) -> None:
    _check(c)
    if not c.get("norm_topk_prob", True) or c.get("routed_scaling_factor", 1.0) != 1.0:
        raise GGUFExportError(
            f"LFM2-MoE routing with norm_topk_prob={c.get('norm_topk_prob')}, routed_scaling_factor="
            f"{c.get('routed_scaling_factor')}: llama.cpp renormalises the top-k weights, unscaled"
        )
    if not c.get("use_expert_bias", True):
        raise GGUFExportError(
            "LFM2-MoE without use_expert_bias: llama.cpp requires the expert bias"
        )


def _items(fam: Family, keys: list[str], c: dict) -> list[Item]:
    rules = [(r"conv\.conv\.weight$", lambda key, gname: [Item(gname, (key,), lambda w: w.squeeze(1))])]  # fmt: skip
    return mapped_items(fam, keys, c, rules, rename=_rename)


def _rename(key: str) -> str:
    """The names gguf's LFM2-MoE map knows: stacked experts without the ``model.`` prefix, the
    expert bias as a ``.bias``."""
    if ".feed_forward.experts." in key:
        key = key.removeprefix("model.")
    return key.replace(".expert_bias", ".expert_bias.bias")


FAMILIES = {
    "Lfm2ForCausalLM": Family(A.LFM2, _keys, _check, _items),
    "Lfm2MoeForCausalLM": Family(A.LFM2MOE, _keys_moe, _check_moe, _items),
}
