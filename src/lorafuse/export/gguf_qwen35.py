"""Qwen3.5 (``qwen35``), Qwen3.5-MoE (``qwen35moe``) and Qwen3-Next (``qwen3next``) as llama.cpp's
converter writes them: Gated DeltaNet layers interleaved with gated full attention.

Linear-attention layers: ``A_log`` is written as ``A = -exp(A_log)`` (``ssm_a``), ``dt_bias`` as
``ssm_dt.bias``, the depthwise conv kernel (C, 1, K) squeezed to (C, K) (``ssm_conv1d``, f32).
Qwen3.5's value heads are stored grouped by key head ([k0: v0 v1][k1: v0 v1]...); llama.cpp
broadcasts key heads tiled ([v0 of k0, v0 of k1, v1 of k0...]), so every value-head axis is
reordered: the V rows of ``in_proj_qkv`` and its conv channels, ``in_proj_z``, ``in_proj_a/b``
rows, ``A_log`` / ``dt_bias``, and ``out_proj``'s columns. Qwen3-Next's fused ``in_proj_qkvz``
(per key head: q, k, its v heads, its z heads) is regrouped into ``attn_qkv`` (all q, all k,
all v) and ``attn_gate`` (all z); its ``in_proj_ba`` stays fused (``ssm_ba``).

Full-attention layers keep ``q_proj`` fused with its output gate (per head [q | gate], 2 x
head_dim rows; llama.cpp splits it in its graph), q/k norms, partial rotary (``rope.dimension_count``
= head_dim x partial_rotary_factor). Every RMSNorm but the gated one of the linear-attention
output stores ``w`` for ``(1 + w)``: written as ``w + 1``. Experts are stacked per projection;
the multi-token-prediction head (``mtp.*``) is not written (llama.cpp runs without it).
"""

from __future__ import annotations

import warnings

import gguf
import torch

from lorafuse.export.gguf_hparams import (
    arch_name,
    head_dim,
    pattern,
    raw_key,
    refuse,
    rope_default_only,
    rope_params,
)
from lorafuse.export.gguf_hparams import keys_text as _keys_text
from lorafuse.export.gguf_layout import Family, Item, gate_up_items, mapped_items, tn
from lorafuse.export.gguf_vocab import GGUFExportError

A = gguf.MODEL_ARCH
T = gguf.MODEL_TENSOR


def _linear_keys(w: gguf.GGUFWriter, c: dict) -> None:
    _keys_text(w, c)
    if c.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    raw_key(w, "attention.recurrent_layers", [t == "linear_attention" for t in _layer_types(c)])
    w.add_full_attention_interval(c.get("full_attention_interval", 4))
    w.add_rope_dimension_count(_rope_dims(c))


def _qwen35_keys(w: gguf.GGUFWriter, c: dict) -> None:
    _linear_keys(w, c)
    # llama.cpp requires the interleaved M-RoPE sections, pair p rotating with section p % 3 (t,
    # h, w; a 4th, vision-only section gets position 0 for text). Text positions are the same on
    # t, h and w, so any split that covers every rotary pair rotates as transformers does: the
    # config's, else one that covers them all ([11, 11, 10] at Qwen3.5's 64 rotary dims)
    pairs = _rope_dims(c) // 2
    default = [len(range(i, pairs, 3)) for i in range(3)]
    sections = list(rope_params(c).get("mrope_section") or default)
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


def _rope_dims(c: dict) -> int:
    return int(head_dim(c) * rope_params(c).get("partial_rotary_factor", 0.25))


def _layer_types(c: dict) -> list[str]:
    n, interval = c["num_hidden_layers"], c.get("full_attention_interval", 4)
    default = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]  # fmt: skip
    return list(c.get("layer_types") or default)


def _check(c: dict) -> None:
    rope_default_only(c)
    refuse(c, attention_bias="llama.cpp's attention has no q/k/v/o bias for it")
    if c.get("hidden_act", "silu") != "silu":
        raise GGUFExportError(f"hidden_act {c['hidden_act']!r}: llama.cpp runs {arch_name(c)} with SiLU")  # fmt: skip
    if c["linear_num_value_heads"] % c["linear_num_key_heads"]:
        raise GGUFExportError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    types = _layer_types(c)
    if set(types) - {"linear_attention", "full_attention"}:
        raise GGUFExportError(f"layer_types {types}: unknown layer type")
    interval = c.get("full_attention_interval", 4)
    if types != [("linear_attention", "full_attention")[(i + 1) % interval == 0] for i in range(len(types))]:  # fmt: skip
        warnings.warn(
            f"layer_types {types} is not every {interval}th layer full attention: written as "
            "attention.recurrent_layers, which llama.cpp builds before that key ignore (they put "
            f"full attention on every {interval}th layer and run this model differently)",
            stacklevel=3,
        )


def _check_moe(c: dict) -> None:
    _check(c)
    # llama.cpp gives every layer the sparse MLP
    pattern(c, [], "mlp_only_layers")
    if c.get("decoder_sparse_step", 1) != 1:
        raise GGUFExportError(f"decoder_sparse_step {c['decoder_sparse_step']}: llama.cpp makes every layer sparse")  # fmt: skip


def _tiled(w: torch.Tensor, dim: int, c: dict, head: int) -> torch.Tensor:
    """Value heads grouped by key head -> tiled along ``dim`` (``head`` elements per head)."""
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    shape = list(w.shape)
    dim %= len(shape)
    w = w.reshape(*shape[:dim], nk, nv // nk, head, *shape[dim + 1 :])
    return w.transpose(dim, dim + 1).reshape(shape)


def _v_rows(w: torch.Tensor, c: dict) -> torch.Tensor:
    """Reorder only the value rows (after q and k) of the conv channels / ``in_proj_qkv``."""
    qk = 2 * c["linear_key_head_dim"] * c["linear_num_key_heads"]
    return torch.cat([w[:qk], _tiled(w[qk:], 0, c, c["linear_value_head_dim"])], dim=0)


def _qkvz(w: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz rows (per key head [q, k, v..., z...]) -> (qkv rows, z rows)."""
    nk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
    dv = c["linear_num_value_heads"] // nk * c["linear_value_head_dim"]
    per = w.reshape(nk, 2 * dk + 2 * dv, w.shape[-1])  # (nk, q+k+v+z, hidden)
    q, k, v, z = per.split([dk, dk, dv, dv], dim=1)
    qkv = torch.cat([p.reshape(-1, w.shape[-1]) for p in (q, k, v)], dim=0)
    return qkv, z.reshape(-1, w.shape[-1])


def _items(fam: Family, keys: list[str], c: dict) -> list[Item]:
    tile = fam.arch != A.QWEN3NEXT  # qwen35 / qwen35moe broadcast key heads tiled
    dv = c["linear_value_head_dim"]
    mtp = [k for k in keys if k.startswith(("mtp.", "model.mtp."))]
    if mtp:
        warnings.warn(f"{len(mtp)} multi-token-prediction tensors (mtp.*) not written: llama.cpp "
                      "generates without them", stacklevel=4)  # fmt: skip
    keys = [k for k in keys if k not in mtp]

    def one(fn):
        return lambda key, gname: [Item(gname, (key,), fn)]

    def qkvz(key, _):
        return [Item(tn(T.ATTN_QKV, key), (key,), lambda w: _qkvz(w, c)[0]),
                Item(tn(T.ATTN_GATE, key), (key,), lambda w: _qkvz(w, c)[1])]  # fmt: skip

    def maybe_tiled(w, dim, head):
        return _tiled(w, dim, c, head) if tile else w

    rules = [
        (r"\.A_log$", one(lambda w: -torch.exp(maybe_tiled(w, 0, 1)))),
        (r"\.dt_bias$", one(lambda w: maybe_tiled(w, 0, 1))),
        (r"linear_attn\.conv1d\.weight$",
         one(lambda w: _v_rows(w.squeeze(1), c) if tile else w.squeeze(1))),
        (r"linear_attn\.in_proj_qkvz\.", qkvz),
        (r"linear_attn\.in_proj_qkv\.", one(lambda w: _v_rows(w, c) if tile else w)),
        (r"linear_attn\.in_proj_z\.", one(lambda w: maybe_tiled(w, 0, dv))),
        (r"linear_attn\.in_proj_[ab]\.", one(lambda w: maybe_tiled(w, 0, 1))),
        (r"linear_attn\.out_proj\.", one(lambda w: maybe_tiled(w, 1, dv))),
        (r"linear_attn\.norm\.weight$", one(lambda w: w)),  # the gated norm: plain w
        (r"norm\.weight$", one(lambda w: w + 1.0)),
        (r"mlp\.experts\.gate_up_proj$", gate_up_items),
        (r"mlp\.experts\.down_proj$", lambda key, _: [Item(tn(T.FFN_DOWN_EXP, key), (key,))]),
    ]  # fmt: skip
    return mapped_items(fam, keys, c, rules, rename=_rename)


def _rename(key: str) -> str:
    return key.replace(".dt_bias", ".dt_proj.bias")


FAMILIES = {
    "Qwen3_5ForCausalLM": Family(A.QWEN35, _qwen35_keys, _check, _items),
    "Qwen3_5MoeForCausalLM": Family(A.QWEN35MOE, _qwen35_keys, _check_moe, _items),
    "Qwen3NextForCausalLM": Family(A.QWEN3NEXT, _linear_keys, _check_moe, _items),
}
