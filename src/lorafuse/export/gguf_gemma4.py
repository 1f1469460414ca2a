"""Gemma 4 text (``Gemma4ForCausalLM`` -> ``gemma4``) as llama.cpp's converter writes it.

Sliding and full layers differ in head size (``head_dim`` / the full layers' ``global_head_dim``,
or ``per_layer_config``): written as ``attention.key_length`` (full) and ``key_length_swa``,
with the layer pattern as ``attention.sliding_window_pattern``. The full layers' "proportional"
rope rotates only ``partial_rotary_factor`` of each head, with frequencies over the whole head:
llama.cpp rotates the whole head and a ``rope_freqs`` tensor of 1 (rotated pairs) and 1e30
(pairs left still) does the rest. Per-layer input embeddings (``embed_tokens_per_layer``, the
model projection and its norm, each layer's gate / projection / norm), the layer output scalar,
KV shared across the last ``num_kv_shared_layers`` layers, q / k norms and a scale-free v norm
are all llama.cpp's. Gemma 4's RMSNorm multiplies by ``w`` (no ``1 + w``), so norms go as stored.
"""

from __future__ import annotations

import gguf
import torch

from lorafuse.export.gguf_hparams import keys_text, rope_params
from lorafuse.export.gguf_layout import Family, Item, mapped_items
from lorafuse.export.gguf_vocab import GGUFExportError

A, T = gguf.MODEL_ARCH, gguf.MODEL_TENSOR


def _full(c: dict, key: str, default):
    """A full-attention layer's ``key`` (``global_*`` or ``per_layer_config``), else ``default``."""
    if c.get(f"global_{key}") is not None:
        return c[f"global_{key}"]
    for i, layer in sorted((c.get("per_layer_config") or {}).items(), key=lambda kv: int(kv[0])):
        if c["layer_types"][int(i)] == "full_attention" and key in layer:
            return layer[key]
    return default


def _keys(w: gguf.GGUFWriter, c: dict) -> None:
    swa = [t == "sliding_attention" for t in c["layer_types"]]
    full_dim = _full(c, "head_dim", c["head_dim"])
    kv_full = _full(c, "num_key_value_heads", None)
    kv = c["num_key_value_heads"]
    heads_kv = [kv if s else kv_full for s in swa] if kv_full is not None else kv
    keys_text(w, {**c, "head_dim": full_dim, "num_key_value_heads": heads_kv})
    # written when unset too: llama.cpp's default is 30 (0 turns it off)
    w.add_final_logit_softcapping(float(c.get("final_logit_softcapping") or 0.0))
    w.add_sliding_window(c["sliding_window"])
    w.add_shared_kv_layers(c.get("num_kv_shared_layers") or 0)
    w.add_embedding_length_per_layer_input(c.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    if c.get("use_double_wide_mlp"):
        first_shared = c["num_hidden_layers"] - (c.get("num_kv_shared_layers") or 0)
        n_ff = c["intermediate_size"]
        w.add_feed_forward_length([n_ff if i < first_shared else 2 * n_ff for i in range(c["num_hidden_layers"])])  # fmt: skip
    w.add_rope_dimension_count(full_dim)  # the whole head: rope_freqs leaves the rest still
    swa_rope = rope_params(c, "sliding_attention")
    w.add_rope_dimension_count_swa(int(c["head_dim"] * swa_rope.get("partial_rotary_factor", 1.0)))


def _check(c: dict) -> None:
    if c.get("enable_moe_block"):
        raise GGUFExportError("Gemma 4 with its MoE block (enable_moe_block): not exported to GGUF here")  # fmt: skip
    full, sliding = rope_params(c, "full_attention"), rope_params(c, "sliding_attention")
    if full["rope_type"] not in ("proportional", "default") or sliding["rope_type"] != "default":
        raise GGUFExportError(
            f"Gemma 4 rope {full['rope_type']!r} (full) / {sliding['rope_type']!r} (sliding): "
            "llama.cpp runs proportional / default"
        )
    if c.get("use_bidirectional_attention"):
        raise GGUFExportError("Gemma 4 text with use_bidirectional_attention: llama.cpp runs it causal")  # fmt: skip
    if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise GGUFExportError(f"hidden_activation {c['hidden_activation']!r}: llama.cpp runs Gemma 4 with tanh-GELU")  # fmt: skip


def rope_freqs(c: dict) -> torch.Tensor:
    """(full head_dim / 2,) frequency divisors: 1 for the rotated pairs, 1e30 for the rest."""
    full = rope_params(c, "full_attention")
    dim = _full(c, "head_dim", c["head_dim"])
    factor = full.get("partial_rotary_factor", 1.0) if full["rope_type"] == "proportional" else 1.0  # fmt: skip
    rotated = int(dim * factor / 2)
    return torch.tensor([1.0] * rotated + [1e30] * (dim // 2 - rotated), dtype=torch.float32)


def _items(fam: Family, keys: list[str], c: dict) -> list[Item]:
    name = gguf.TENSOR_NAMES[T.ROPE_FREQS] + ".weight"
    items = [Item(name, (), lambda: rope_freqs(c))]
    rename = lambda k: k + ".weight" if k.endswith(("layer_scalar", "per_dim_scale")) else k  # noqa: E731
    return items + mapped_items(fam, keys, c, rename=rename)


FAMILIES = {"Gemma4ForCausalLM": Family(A.GEMMA4, _keys, _check, _items, tied_always=True)}
