"""gpt-oss (``gpt-oss``) as llama.cpp's converter writes it: attention with q/k/v/o biases and
per-head sinks, sliding and full layers alternating, a biased router over experts with biases.

transformers keeps the experts as (E, in, out) products whose gate and up columns interleave
(``gate_up_proj[..., 0::2]`` gate, ``[..., 1::2]`` up); llama.cpp wants (E, out, in) stacks of
each. Dense experts (a merged fine-tune, fp32 / bf16) are transposed, split and written in the
outtype, as the converter does with them. The release checkpoints store the expert matrices in
MXFP4 (``*_blocks``: E, rows, blocks, 16 bytes of 4-bit codes, element 2i in the low nibble;
``*_scales``: E, rows, blocks of E8M0 exponents): those are repacked bit for bit into ggml's
MXFP4 blocks (a scale byte, then 16 bytes holding element j low and j + 16 high) whatever the
outtype, as the converter does, never dequantized; llama.cpp's quantizer leaves them as they are.
"""

from __future__ import annotations

import warnings

import gguf
import torch

from lorafuse.export.gguf_hparams import keys_text, pattern, rope_default_only, rope_params
from lorafuse.export.gguf_layout import Family, Item, mapped_items, tn
from lorafuse.export.gguf_vocab import GGUFExportError

A, T = gguf.MODEL_ARCH, gguf.MODEL_TENSOR
Q = gguf.GGMLQuantizationType
# llama.cpp's gpt-oss SwiGLU constants (``ggml_swiglu_oai``)
ALPHA, LIMIT = 1.702, 7.0


def _keys(w: gguf.GGUFWriter, c: dict) -> None:
    keys_text(w, c)
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])


def _check(c: dict) -> None:
    rope_default_only(c, ("default", "yarn"))
    rope = rope_params(c)
    if rope["rope_type"] == "yarn" and not rope.get("truncate", True):
        # not refused: every gpt-oss checkpoint has it, and llama.cpp runs all of them this way
        warnings.warn(
            "gpt-oss YaRN with truncate=false (the release configs'): llama.cpp always rounds the "
            "YaRN correction range to whole dimensions (truncate=true), so in llama.cpp the "
            "rotary frequencies in that range differ from transformers' (gpt-oss-20b's: 9 of "
            "32, by up to 43%) and its logits differ from transformers' on the same weights",
            stacklevel=3,
        )
    n = c["num_hidden_layers"]
    # llama.cpp's default pattern (no key written, as the converter): sliding on even layers
    pattern(c, ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)], "layer_types")  # fmt: skip
    if (c.get("swiglu_alpha", ALPHA), c.get("swiglu_limit", LIMIT)) != (ALPHA, LIMIT):
        raise GGUFExportError(
            f"gpt-oss SwiGLU alpha {c.get('swiglu_alpha')} / limit {c.get('swiglu_limit')}: "
            f"llama.cpp computes it with {ALPHA} / {LIMIT}"
        )


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 (blocks (..., n, 16) uint8, element 2i low nibble; scales (..., n))
    -> ggml ``block_mxfp4`` bytes (..., n * 17): the scale, then byte j = element j | j+16 << 4."""
    vals = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # (..., n, 32) codes
    qs = vals[..., :16] | (vals[..., 16:] << 4)  # (..., n, 16)
    out = torch.cat((scales.unsqueeze(-1), qs), dim=-1)  # (..., n, 17)
    return out.flatten(-2)


def _items(fam: Family, keys: list[str], c: dict) -> list[Item]:
    stored = set(keys)

    def gate_up(key, _):  # (E, in, 2 x out) interleaved -> gate / up, (E, out, in) each
        return [Item(tn(T.FFN_GATE_EXP, key), (key,), lambda w: w.transpose(1, 2)[:, 0::2]),
                Item(tn(T.FFN_UP_EXP, key), (key,), lambda w: w.transpose(1, 2)[:, 1::2])]  # fmt: skip

    def gate_up_bias(key, _):
        return [Item(tn(T.FFN_GATE_EXP, key, ".bias"), (key,), lambda b: b[:, 0::2]),
                Item(tn(T.FFN_UP_EXP, key, ".bias"), (key,), lambda b: b[:, 1::2])]  # fmt: skip

    def mxfp4(key, _):  # the *_blocks key; its *_scales is consumed with it
        pair = (key, key.replace("_blocks", "_scales"))
        if pair[1] not in stored:
            raise GGUFExportError(f"{key} without {pair[1]}")
        raw = lambda b, s: mxfp4_blocks(b, s)  # noqa: E731
        if "gate_up" in key:  # gate / up rows interleave
            return [Item(tn(T.FFN_GATE_EXP, key), pair, lambda b, s: raw(b[:, 0::2], s[:, 0::2]), Q.MXFP4),
                    Item(tn(T.FFN_UP_EXP, key), pair, lambda b, s: raw(b[:, 1::2], s[:, 1::2]), Q.MXFP4)]  # fmt: skip
        return [Item(tn(T.FFN_DOWN_EXP, key), pair, raw, Q.MXFP4)]

    rules = [
        (r"experts\.gate_up_proj$", gate_up),
        (r"experts\.gate_up_proj_bias$", gate_up_bias),
        (r"experts\.down_proj$", lambda key, _: [Item(tn(T.FFN_DOWN_EXP, key), (key,), lambda w: w.transpose(1, 2))]),  # fmt: skip
        (r"experts\.down_proj_bias$", lambda key, _: [Item(tn(T.FFN_DOWN_EXP, key, ".bias"), (key,))]),  # fmt: skip
        (r"_blocks$", mxfp4),
        (r"_scales$", lambda key, _: []),
        (r"\.sinks$", lambda key, _: [Item(tn(T.ATTN_SINKS, key), (key,))]),
    ]  # fmt: skip
    return mapped_items(fam, keys, c, rules)


# mxfp4: the release checkpoints' experts, repacked as they are
FAMILIES = {"GptOssForCausalLM": Family(A.GPT_OSS, _keys, _check, _items, stored=("mxfp4",))}
