"""Write a Hugging Face model directory as a GGUF file (no llama.cpp build needed).

Tensor layout follows llama.cpp's ``convert_hf_to_gguf.py`` for each supported architecture
(``gguf_families``): names from ``gguf.TensorNameMap`` (``blk.N.attn_q.weight``...) and the
converter's transforms, each GGUF tensor an ``Item`` computed from the checkpoint's tensors
(``gguf_layout``). For the archs llama.cpp runs with its "norm" rope (llama, smollm3) q/k
projections are permuted from HF's rotate-half rotary layout to GGML's interleaved one:

    W.reshape(n_head, 2, D/2, in).swapaxes(1, 2).reshape(out, in)      # (out, in)

which transformers' GGUF loader (``LlamaTensorProcessor._reverse_permute_weights``) undoes.
Norms, 1-D tensors, routers and conv kernels are always f32, as llama.cpp keeps them; matrices
and expert stacks take ``outtype`` (q8_0 rows whose length is not a multiple of 32 fall back to
f16, as llama.cpp does, with a warning). The other quantized outtypes (``QUANTIZED``: q4_k_m, q6_k...) are made by llama.cpp's
own quantizer (the ``cyllama`` binding) from an f32/bf16 intermediate that is then deleted.
Tensors are streamed: the header is written from the safetensors metadata, then each tensor is
loaded, converted and appended, so peak memory is about one tensor. The file is written to a
temp name next to the target and renamed when complete.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from lorafuse import files
from lorafuse.export.gguf_families import FAMILIES, family
from lorafuse.export.gguf_layout import Family, Item, meta_shape, tensor_type
from lorafuse.export.gguf_vocab import GGUFExportError, add_vocab, loadable_name, read_vocab
from lorafuse.export.merge import base_shards, stored_quantized
from lorafuse.export.ollama import write_modelfile  # noqa: F401 - re-exported for the export command

Q = gguf.GGMLQuantizationType
OUTTYPES = {"f32": (Q.F32, gguf.LlamaFileType.ALL_F32), "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
            "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16), "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}  # fmt: skip
F = gguf.LlamaFileType
# made by llama.cpp's quantizer (llama_model_quantize) from an f32/bf16 intermediate
QUANTIZED = {"q4_0": F.MOSTLY_Q4_0, "q4_1": F.MOSTLY_Q4_1, "q5_0": F.MOSTLY_Q5_0,
             "q5_1": F.MOSTLY_Q5_1, "q2_k": F.MOSTLY_Q2_K, "q3_k_s": F.MOSTLY_Q3_K_S,
             "q3_k_m": F.MOSTLY_Q3_K_M, "q3_k_l": F.MOSTLY_Q3_K_L, "q4_k_s": F.MOSTLY_Q4_K_S,
             "q4_k_m": F.MOSTLY_Q4_K_M, "q5_k_s": F.MOSTLY_Q5_K_S, "q5_k_m": F.MOSTLY_Q5_K_M,
             "q6_k": F.MOSTLY_Q6_K}  # fmt: skip
ALL_OUTTYPES = sorted([*OUTTYPES, *QUANTIZED])
ARCHITECTURES = sorted(FAMILIES)


def check_exportable(config: dict, outtype: str) -> None:
    """Raise GGUFExportError for anything this writer cannot express (before writing)."""
    if outtype not in OUTTYPES and outtype not in QUANTIZED:
        raise GGUFExportError(
            f"GGUF outtype {outtype!r} not supported; choose one of {ALL_OUTTYPES}"
        )
    fam = family(config)
    if stored_quantized(config) and stored_quantized(config) not in fam.stored:
        raise GGUFExportError(
            "model is stored quantized; export needs original-precision (merged) weights"
        )
    fam.check(config)


def _add_metadata(writer: gguf.GGUFWriter, config: dict, fam: Family, name: str, file_type) -> None:
    writer.add_name(name)
    fam.keys(writer, config)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _shards(model_dir: Path) -> dict[str, tuple[Path, list[int]]]:
    """{stored tensor name: (its safetensors file, its shape)}."""
    where = {}
    for shard in base_shards(model_dir):
        with safe_open(str(shard), framework="pt") as f:
            where.update({k: (shard, list(f.get_slice(k).get_shape())) for k in f.keys()})
    return where


def _plan(where: dict[str, tuple[Path, list[int]]], config: dict, fam: Family,
          qtype) -> list[tuple[Item, list[int], Q]]:  # fmt: skip
    """[(item, shape, ggml type)] for every GGUF tensor, in writing order (no data read)."""
    shapes = {k: shape for k, (_, shape) in where.items()}
    plan = []
    for item in fam.plan(list(shapes), config):
        shape = meta_shape(item, shapes)
        plan.append((item, shape, tensor_type(item, len(shape), qtype, shape)))
    return plan


def _load(item: Item, where: dict[str, tuple[Path, list[int]]]) -> torch.Tensor:
    """The tensor as llama.cpp's converter writes it, before type conversion."""
    tensors = []
    for key in item.sources:
        with safe_open(str(where[key][0]), framework="pt") as f:
            t = f.get_tensor(key)
        tensors.append(t if item.raw is not None or t.dtype == torch.float32 else t.float())
    return item.fn(*tensors)


def convert_tensor(t: torch.Tensor, qtype) -> np.ndarray:
    """fp32 tensor -> numpy array in ggml ``qtype`` (raw bytes for quantized/bf16)."""
    a = t.float().contiguous().numpy()
    if qtype == Q.F32:
        return a
    if qtype == Q.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(a, qtype)  # bf16 / q8_0 -> uint8 byte rows


def write_gguf(model_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f16",
               name: str | None = None, overwrite: bool = False, pre: str | None = None) -> Path:  # fmt: skip
    """Export the HF model in ``model_dir`` (merged, original precision) to ``out_path``.

    ``pre`` forces llama.cpp's pre-tokenizer name (default: identified as llama.cpp's converter
    does, see ``gguf_pretokenizer``; an unidentifiable tokenizer raises before writing).
    ``outtype`` in ``QUANTIZED`` goes through llama.cpp's quantizer (see ``quantize_gguf``).
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    check_exportable(config, outtype)
    if out_path.exists() and not overwrite:
        raise GGUFExportError(f"output {out_path} exists (use --force to replace it)")
    if outtype in QUANTIZED:
        # bf16 keeps a bf16 checkpoint exact at half the f32 intermediate's disk
        mid = "f32" if config.get("dtype", config.get("torch_dtype")) == "float32" else "bf16"
        tmp = out_path.with_name(f".{out_path.name}.{mid}-{os.getpid()}.gguf")
        try:
            write_gguf(model_dir, tmp, mid, name=name, overwrite=True, pre=pre)
            return quantize_gguf(tmp, out_path, outtype)
        finally:
            tmp.unlink(missing_ok=True)
    fam = family(config)
    qtype, file_type = OUTTYPES[outtype]
    vocab = read_vocab(model_dir, config["vocab_size"], pre=pre)
    where = _shards(model_dir)
    plan = _plan(where, config, fam, qtype)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with files.disk_full_as_error("the GGUF file", out_path, then="its partial file was removed"):
        with files.atomic_path(out_path) as tmp:
            writer = gguf.GGUFWriter(None, fam.name)
            try:
                _add_metadata(
                    writer, config, fam, loadable_name(name or model_dir.name, vocab), file_type
                )
                add_vocab(writer, vocab)
                if fam.norm_shift and vocab.model == "llama":  # Gemma's sentencepiece vocab
                    writer.add_add_space_prefix(False)  # as the converter writes it
                for item, shape, t in plan:
                    _add_info(writer, item, shape, t)
                writer.write_header_to_file(path=tmp)
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                for item, _, t in tqdm(plan, desc=f"writing GGUF {outtype}", unit="tensor"):
                    w = _load(item, where)
                    writer.write_tensor_data(w.numpy() if item.raw else convert_tensor(w, t))
            finally:
                writer.close()
    return out_path


def _add_info(writer: gguf.GGUFWriter, item: Item, shape: list[int], t: Q) -> None:
    if t in (Q.F32, Q.F16):
        size = 4 if t == Q.F32 else 2
        dtype = np.dtype(np.float32 if t == Q.F32 else np.float16)
        writer.add_tensor_info(item.name, shape, dtype, int(np.prod(shape)) * size)
        return
    # raw items come as ggml bytes already; the others are converted to them when written
    byte_shape = shape if item.raw else gguf.quant_shape_to_byte_shape(shape, t)
    writer.add_tensor_info(item.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                           raw_dtype=t)  # fmt: skip


def quantize_gguf(src: str | os.PathLike, out_path: str | os.PathLike, outtype: str,
                  threads: int | None = None) -> Path:  # fmt: skip
    """Quantize the f32/f16/bf16 GGUF ``src`` to ``outtype`` with llama.cpp's own quantizer.

    K-quants need rows that are a multiple of 256; llama.cpp stores other tensors in a fallback
    type (q5_0 / q8_0...), which is reported here rather than left to its log.
    """
    import cyllama.llama.llama_cpp as cy

    if outtype not in QUANTIZED:
        raise GGUFExportError(
            f"quantized outtype {outtype!r} unknown; choose one of {sorted(QUANTIZED)}"
        )
    src, out_path = Path(src), Path(out_path)
    reader = gguf.GGUFReader(src)
    if "_k" in outtype:
        mats = [t for t in reader.tensors if quantizes(t.name, len(t.shape))]
        odd = [t.name for t in mats if int(t.shape[0]) % 256]  # shape[0]: the row length
        if odd:
            warnings.warn(
                f"{len(odd)} of {len(mats)} matrices have rows not a multiple of 256 "
                f"(e.g. {odd[0]}): llama.cpp stores them in a fallback type, not {outtype}",
                stacklevel=2,
            )
    del reader
    params = cy.LlamaModelQuantizeParams()
    params.ftype = int(QUANTIZED[outtype])
    params.nthread = threads or os.cpu_count() or 1
    print(f"quantizing {src.name} to {outtype} with llama.cpp ({params.nthread} threads)")
    try:
        with files.disk_full_as_error(
            "the GGUF file", out_path, then="its partial file was removed"
        ):
            with files.atomic_path(out_path) as tmp:
                _quantize(cy, src, tmp, params)
    except RuntimeError as err:
        raise GGUFExportError(f"llama.cpp could not quantize {src} to {outtype}: {err}") from err
    return out_path


# names llama.cpp's quantizer leaves as they are (``tensor_allows_quantization`` in llama-quant.cpp)
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "per_layer_model_proj", "ssm_conv1d",
                  "shortconv.conv.weight", "altup", "laurel")  # fmt: skip


def quantizes(name: str, ndim: int) -> bool:
    """Whether llama.cpp's quantizer quantizes tensor ``name``: matrices and expert stacks whose
    name ends in ``weight``, but not norms, routers, conv kernels..."""
    return 2 <= ndim <= 3 and name.endswith("weight") and not any(n in name for n in _NOT_QUANTIZED)


# llama.cpp's quantizer says ENOSPC only in its log and returns "failed with code 1"; a write that
# failed for room leaves the file system full to the last block, so a failure with less free
# than this (while its partial output still exists) is a full disk.
FULL_BELOW_BYTES = 1 << 20


def _quantize(cy, src: Path, tmp: Path, params) -> None:
    try:
        cy.model_quantize(str(src), str(tmp), params)
    except RuntimeError as err:
        if files.free_bytes(tmp) < FULL_BELOW_BYTES:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({err})") from err
        raise
