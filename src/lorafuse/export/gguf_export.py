"""Write a Hugging Face Llama-family model directory as a GGUF file (no llama.cpp build needed).

Tensor layout follows llama.cpp's ``convert_hf_to_gguf.py`` for the ``llama`` architecture:
names from ``gguf.TensorNameMap`` (``blk.N.attn_q.weight``...), and q/k projections permuted
from HF's rotate-half rotary layout to GGML's interleaved one:

    W.reshape(n_head, 2, D/2, in).swapaxes(1, 2).reshape(out, in)      # (out, in)

which transformers' GGUF loader (``LlamaTensorProcessor._reverse_permute_weights``) undoes.
1-D tensors (norms) are always f32, as llama.cpp keeps them; 2-D ones take ``outtype``
(q8_0 rows whose length is not a multiple of 32 fall back to f16, as llama.cpp does, with a
warning). Tensors are streamed: the header is written from the safetensors metadata, then each
tensor is loaded, converted and appended, so peak memory is about one tensor. The file is written
to a temp name next to the target and renamed when complete.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from lorafuse.export.gguf_vocab import GGUFExportError, add_vocab, read_vocab
from lorafuse.export.merge import base_shards, stored_quantized
from lorafuse.export.ollama import write_modelfile  # noqa: F401 - re-exported for the export command

Q = gguf.GGMLQuantizationType
OUTTYPES = {"f32": (Q.F32, gguf.LlamaFileType.ALL_F32), "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
            "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16), "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}  # fmt: skip
# HF architectures written as llama.cpp's "llama" arch (llama.cpp converts Mistral the same way)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}


def check_exportable(config: dict, outtype: str) -> None:
    """Raise GGUFExportError for anything this writer cannot express (before writing)."""
    if outtype not in OUTTYPES:
        raise GGUFExportError(
            f"GGUF outtype {outtype!r} not supported; choose one of {sorted(OUTTYPES)}"
        )
    archs = config.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise GGUFExportError(
            f"architecture {archs or config.get('model_type')} not supported for GGUF export; supported: {sorted(ARCHITECTURES)}"
        )
    if stored_quantized(config):
        raise GGUFExportError(
            "model is stored quantized; export needs original-precision (merged) weights"
        )
    # transformers 5 keeps rope type/theta in rope_parameters, older versions in rope_scaling
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in (None, "default"):
        # llama3 / yarn / linear need extra GGUF keys or a rope_freqs tensor that transformers'
        # GGUF loader does not read back, so the round-trip guarantee would not hold
        raise GGUFExportError(
            f"rope scaling type {rope_type!r} is not supported by this GGUF writer"
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise GGUFExportError("attention_bias / mlp_bias Llama variants are not supported")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim * config["num_attention_heads"] != config["hidden_size"]:
        raise GGUFExportError("head_dim * num_attention_heads != hidden_size is not supported")


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half q/k rows -> GGML interleaved rows; (out, in) -> (out, in)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _add_metadata(writer: gguf.GGUFWriter, config: dict, name: str, file_type) -> None:
    heads = config["num_attention_heads"]
    writer.add_name(name)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base(
        float(
            config.get("rope_theta")
            or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        )
    )
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _plan(model_dir: Path, config: dict, qtype) -> list[tuple[str, str, Path, Q]]:
    """[(hf name, gguf name, shard, ggml type)] for every tensor to write."""
    n_layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    plan = []
    for shard in base_shards(model_dir):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                if key == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue  # no output.weight: llama.cpp / transformers tie it to token_embd
                gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if gname is None:
                    raise GGUFExportError(f"tensor {key} has no GGUF llama name")
                shape = f.get_slice(key).get_shape()
                t = qtype if len(shape) == 2 else Q.F32
                if t == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
                    warnings.warn(
                        f"{key}: row length {shape[-1]} not a multiple of 32; stored as f16",
                        stacklevel=2,
                    )
                    t = Q.F16
                plan.append((key, gname, shard, t))
    return plan


def _convert(t: torch.Tensor, qtype) -> np.ndarray:
    """fp32 tensor -> numpy array in ggml ``qtype`` (raw bytes for quantized/bf16)."""
    a = t.float().contiguous().numpy()
    if qtype == Q.F32:
        return a
    if qtype == Q.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(a, qtype)  # bf16 / q8_0 -> uint8 byte rows


def write_gguf(model_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f16",
               name: str | None = None, overwrite: bool = False, pre: str | None = None) -> Path:  # fmt: skip
    """Export the HF Llama-family model in ``model_dir`` (merged, original precision) to ``out_path``.

    ``pre`` forces llama.cpp's pre-tokenizer name (default: identified as llama.cpp's converter
    does, see ``gguf_pretokenizer``; an unidentifiable tokenizer raises before writing).
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    check_exportable(config, outtype)
    if out_path.exists() and not overwrite:
        raise GGUFExportError(f"output {out_path} exists (use --force to replace it)")
    qtype, file_type = OUTTYPES[outtype]
    vocab = read_vocab(model_dir, config["vocab_size"], pre=pre)
    plan = _plan(model_dir, config, qtype)
    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads") or config["num_attention_heads"],
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(None, ARCHITECTURES[config["architectures"][0]])
    try:
        _add_metadata(writer, config, name or model_dir.name, file_type)
        add_vocab(writer, vocab)
        for key, gname, shard, t in plan:
            with safe_open(str(shard), framework="pt") as f:
                shape = list(f.get_slice(key).get_shape())
            if t in (Q.F32, Q.F16):
                dtype, nbytes = (
                    np.dtype(np.float32 if t == Q.F32 else np.float16),
                    int(np.prod(shape)) * (4 if t == Q.F32 else 2),
                )
                writer.add_tensor_info(gname, shape, dtype, nbytes)
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, t)
                writer.add_tensor_info(
                    gname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=t
                )
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for key, gname, shard, t in tqdm(plan, desc=f"writing GGUF {outtype}", unit="tensor"):
            with safe_open(str(shard), framework="pt") as f:
                w = f.get_tensor(key)
            if gname.endswith("attn_q.weight"):
                w = _permute(w, heads)
            elif gname.endswith("attn_k.weight"):
                w = _permute(w, kv_heads)
            writer.write_tensor_data(_convert(w, t))
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path
