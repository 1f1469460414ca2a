"""gpt-oss's release checkpoints store the expert matrices in MXFP4 (``*_blocks`` / ``*_scales``,
``quantization_config.quant_method = mxfp4``). The export repacks them into ggml's MXFP4 blocks
as llama.cpp's converter does, never dequantized: gguf-py's own MXFP4 decoder reads back exactly
the dequantized checkpoint, and llama.cpp runs the file with the greedy tokens transformers gives
on those dequantized weights. A tiny gpt-oss is quantized here the way the checkpoints are laid
out (rows = output features, 32-value blocks along the input, element 2i in the low nibble,
E8M0 exponents biased by 127).
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf_families_2026 import RUNNABLE
from test_gguf_lora import _hf_greedy, _llama_cpp_greedy

from lorafuse.export.gguf_export import write_gguf
from lorafuse.testing.new_families import save_family_model

ARCH = "GptOssForCausalLM"
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # fmt: skip


def to_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(..., n) fp32 -> (blocks (..., n/32, 16) uint8, scales (..., n/32) uint8, dequantized)."""
    x = rows.reshape(*rows.shape[:-1], -1, 32)  # (..., n/32, 32)
    exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-30) / 6.0))  # (..., n/32)
    scaled = x / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - FP4).abs().argmin(-1).to(torch.uint8)  # (..., n/32, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    dequant = (FP4[codes.long()] * torch.exp2(exp)[..., None]).reshape(rows.shape)
    return blocks, (exp + 127).to(torch.uint8), dequant


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory, smol_tokenizer):
    """``mxfp4/``: a tiny gpt-oss with MXFP4 experts as the release checkpoints store them;
    ``dense/``: the same model with those experts dequantized (transformers' oracle)."""
    root = tmp_path_factory.mktemp("gptoss")
    save_family_model(ARCH, root / "dense", smol_tokenizer, **RUNNABLE[ARCH])
    shutil.copytree(root / "dense", root / "mxfp4")
    tensors = load_file(root / "dense" / "model.safetensors")
    dense, packed = dict(tensors), dict(tensors)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(key).transpose(1, 2).contiguous()  # (E, in, out) -> (E, out, in)
        blocks, scales, dequant = to_mxfp4(rows)
        dense[key] = dequant.transpose(1, 2).contiguous()
        del packed[key]
        packed[f"{key}_blocks"], packed[f"{key}_scales"] = blocks, scales
    save_file(dense, root / "dense" / "model.safetensors", metadata={"format": "pt"})
    save_file(packed, root / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (root / "mxfp4" / "config.json").write_text(json.dumps(config))
    return root


def test_mxfp4_experts_are_repacked_bit_for_bit(mxfp4_dirs, tmp_path):
    path = write_gguf(mxfp4_dirs / "mxfp4", tmp_path / "m.gguf", "f32", pre="smollm")
    dense = load_file(mxfp4_dirs / "dense" / "model.safetensors")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = dense[prefix + "gate_up_proj"].transpose(1, 2)  # (E, 2I, H), gate/up interleaved
        want = {"ffn_gate_exps": gate_up[:, 0::2], "ffn_up_exps": gate_up[:, 1::2],
                "ffn_down_exps": dense[prefix + "down_proj"].transpose(1, 2)}  # fmt: skip
        for kind, w in want.items():
            t = tensors[f"blk.{layer}.{kind}.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4, kind
            got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            np.testing.assert_array_equal(got.reshape(w.shape), w.numpy(), err_msg=kind)


def test_mxfp4_gguf_greedy_in_llama_cpp_equals_transformers_on_the_dequantized_weights(
    mxfp4_dirs, smol_tokenizer, tmp_path, close
):
    from transformers import AutoModelForCausalLM

    path = write_gguf(mxfp4_dirs / "mxfp4", tmp_path / "m.gguf", "f32", pre="smollm")
    model = AutoModelForCausalLM.from_pretrained(mxfp4_dirs / "dense", dtype=torch.float32).eval()
    ids = smol_tokenizer(" ".join(f"item {i}: the quick brown fox;" for i in range(17)))["input_ids"]  # fmt: skip
    (got, got_logits), (want, want_logits) = _llama_cpp_greedy(path, ids, 6), _hf_greedy(model, ids, 6)  # fmt: skip
    assert got == want
    # ggml multiplies MXFP4 weights by activations rounded to 8-bit blocks (its MXFP4 dot
    # product's q8_0 operand): measured 3.3e-4 on logits of ~5, where the f32 export's gap is
    # 3e-6; a wrong nibble order, row interleave or scale moves them by O(1)
    close(torch.from_numpy(got_logits), want_logits, atol=1e-3, rtol=0.0, name="mxfp4")
