"""Fold a LoRA adapter into the base weights, one safetensors shard at a time.

    W' = cast(W.float() + s * (B.float() @ A.float()), W.dtype)     s = alpha / r (alpha / sqrt(r) rsLoRA)

LoRA on parameters (mixture-of-experts tensors and routers, PEFT's ``ParamWrapper``):
:mod:`lorafuse.export.merge_experts` folds each expert's ``s·B_e·A_e`` into the tensors the
checkpoint stores (per expert or fused, as transformers saved them).

DoRA (Linear layers): PEFT's merge, ``W' = m / ||W + s B A||_row * (W + s B A)``, the norm over
each output row, all in fp32 (the magnitude ``m`` is folded in; nothing DoRA-specific remains).

The base checkpoint is streamed tensor by tensor from its safetensors shards (memory-mapped,
``safe_open``) and written out in shards of at most ``max_shard_size`` bytes, so peak memory is
about one output shard plus the adapter, never the whole model. The math is fp32 whatever the
storage dtype, then cast back to each tensor's own dtype (or ``dtype``).

QLoRA: a 4-bit base is only quantised when *loaded*; its directory holds the original-precision
weights, and that is what gets merged (never re-quantised). A directory that is itself stored
quantised (``quantization_config`` in config.json) is refused: there is no exact source there.

Output: a stock Hugging Face model dir (config.json, generation_config.json, tokenizer files,
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``), written to a temp dir
next to the target and renamed into place, so a crash never leaves a half-written model.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from lorafuse import files
from lorafuse.errors import LorafuseError
from lorafuse.export import merge_experts
from lorafuse.models.source import SOURCE_MARKER

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
    "processor_config.json", "preprocessor_config.json",  # vision-language models' processors
)  # fmt: skip
_PREFIX = "base_model.model."


@dataclass
class LoraDelta:
    """One adapted weight: delta = scale * (B @ A), (out, in); ``transpose`` for Conv1D/embeddings."""

    A: torch.Tensor  # (r, in)
    B: torch.Tensor  # (out, r)
    scale: float
    transpose: bool = False
    magnitude: torch.Tensor | None = None  # DoRA: (out,), the row norms the merged weight gets

    def apply(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        delta = self.scale * (self.B.float() @ self.A.float())  # (out, in) fp32
        w = weight.float().T if self.transpose else weight.float()  # (out, in)
        if tuple(delta.shape) != tuple(w.shape):
            raise LorafuseError(
                f"adapter delta shape {tuple(delta.shape)} != base weight {tuple(weight.shape)}"
            )
        merged = w + delta
        if self.magnitude is not None:  # DoRA: rescale every output row to its magnitude
            if tuple(self.magnitude.shape) != (merged.shape[0],):
                raise LorafuseError(
                    f"DoRA magnitude shape {tuple(self.magnitude.shape)} != ({merged.shape[0]},)"
                )
            norm = torch.linalg.norm(merged, dim=1)
            merged = merged * (self.magnitude.float() / norm).unsqueeze(1)
        return (merged.T if self.transpose else merged).to(dtype)


def dora_reason(adapter_dir: str | os.PathLike) -> str | None:
    """Why ``adapter_dir`` cannot be written as a plain LoRA adapter (e.g. a GGUF LoRA): a line
    naming DoRA, or None. llama.cpp's LoRA format has no magnitude vector; merge it instead."""
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    if cfg.get("use_dora"):
        return (
            f"{adapter_dir}: a DoRA adapter (use_dora) has a magnitude vector that a LoRA "
            "adapter file cannot express; merge it into the base instead (lorafuse merge / export)"
        )
    return None


def _pattern_value(patterns: dict, module: str, default):
    # PEFT's rule (peft.tuners.tuners_utils): key matches "(.*\.)?{key}$" against the module name.
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_adapter(
    adapter_dir: str | os.PathLike,
) -> tuple[dict[str, LoraDelta], dict[str, torch.Tensor]]:
    """(deltas keyed by base weight name, full replacement tensors keyed by base name)."""
    adir = Path(adapter_dir)
    cfg = json.loads((adir / "adapter_config.json").read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LorafuseError(f"{adir}: peft_type {cfg.get('peft_type')!r} is not LoRA; cannot merge")
    weights = adir / "adapter_model.safetensors"
    if not weights.is_file():
        raise LorafuseError(f"{adir}: adapter_model.safetensors missing")
    tensors = load_file(str(weights))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    replace: dict[str, torch.Tensor] = {}
    kinds = "lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector"
    for key, t in tensors.items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        m = re.match(rf"(.+)\.({kinds})(\.weight)?$", name)
        if m:
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
        else:  # modules_to_save / trained biases: the saved tensor replaces the base tensor
            replace[name.replace(".modules_to_save.", ".").replace(".original_module.", ".")] = t
    deltas = {}
    for module, ab in pairs.items():
        r = _pattern_value(cfg.get("rank_pattern"), module, cfg["r"])
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg["lora_alpha"])
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        magnitude = ab.get("lora_magnitude_vector")
        if magnitude is not None and (
            "lora_A" not in ab or ab["lora_A"].ndim != 2 or magnitude.ndim != 1
        ):
            raise LorafuseError(
                f"{adir}: module {module}: DoRA merge covers Linear layers only "
                f"(this one holds {sorted(ab)}, magnitude shape {tuple(magnitude.shape)})"
            )
        if "lora_A" in ab and "lora_B" in ab:
            deltas[module + ".weight"] = LoraDelta(
                ab["lora_A"], ab["lora_B"], scale, bool(cfg.get("fan_in_fan_out")), magnitude
            )
        elif "lora_embedding_A" in ab and "lora_embedding_B" in ab:
            # PEFT Embedding: A (r, num_embeddings), B (dim, r); delta weight = (B @ A).T
            deltas[module + ".weight"] = LoraDelta(
                ab["lora_embedding_A"], ab["lora_embedding_B"], scale, True
            )
        else:
            raise LorafuseError(f"{adir}: module {module} has an incomplete LoRA pair {sorted(ab)}")
    return deltas, replace


def base_shards(base_dir: Path) -> list[Path]:
    """The base checkpoint's safetensors files, in index order."""
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        files = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [base_dir / f for f in files]
    single = base_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise LorafuseError(
        f"{base_dir}: no model.safetensors or model.safetensors.index.json (only safetensors bases can be merged)"
    )


def stored_quantized(config: dict) -> str | None:
    """The quantisation method of the *stored* weights, or None for dense weights.

    A dir converted from a GGUF file keeps ``quantization_config: {"quant_method": "gguf"}`` but
    its safetensors hold the dequantised dense weights, so it counts as dense.
    """
    method = (config.get("quantization_config") or {}).get("quant_method")
    return None if method in (None, "gguf") else str(method)


def checkpoint_keys(base_dir: Path, config: dict, names) -> dict[str, str]:
    """Module parameter names -> the names the base's safetensors use. They differ where
    transformers renames on load (Qwen2-VL: ``model.language_model.layers`` is stored as
    ``model.layers``, ``model.visual`` as ``visual``); its own reverse mapping, on a model built
    on the meta device, gives the stored names. Text-only models map to themselves."""
    names = list(names)
    if "vision_config" not in config or not names:
        return {n: n for n in names}
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(base_dir))
    out = {}
    for name in names:  # one at a time: the renamings are one-to-one
        (stored,) = revert_weight_conversion(model, {name: torch.empty(0, device="meta")})
        out[name] = stored
    return out


def _check_base_config(base_dir: Path, deltas: dict, replace: dict) -> dict:
    config = json.loads((base_dir / "config.json").read_text())
    if stored_quantized(config):
        raise LorafuseError(
            f"{base_dir} stores quantized weights ({stored_quantized(config)}); "
            "merge needs the original-precision base (the dir QLoRA loaded in 4 bit)"
        )
    if config.get("tie_word_embeddings"):
        touched = [
            k for k in [*deltas, *replace] if k.startswith(("model.embed_tokens", "lm_head"))
        ]
        if touched:
            raise LorafuseError(
                f"adapter changes tied embedding weights {touched}; untied merge is not supported"
            )
    return config


class _ShardWriter:
    """Accumulates tensors and flushes a safetensors file whenever ``max_bytes`` is reached."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []  # (temp file name, keys)
        self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buffer[key] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.buffer, str(self.out_dir / name), metadata={"format": "pt"})
        self.files.append((name, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def finish(self) -> None:
        """Rename parts to HF's model-0000i-of-0000N names and write the index."""
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, (tmp, keys) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / tmp, self.out_dir / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def parse_size(text: str | int) -> int:
    """'2GB' / '500MB' / '40KB' / int bytes -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.I)
    if not m:
        raise LorafuseError(f"bad size {text!r}: use e.g. 2GB, 500MB")
    unit = (m.group(2) or "B").upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit])


def merge_adapter(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "2GB",
    tokenizer_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Merge ``adapter_dir`` into the HF model in ``base_dir``; write an HF dir at ``out_dir``.

    ``adapter_dir=None`` re-shards / casts the base alone (``lorafuse export --format safetensors``).
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise LorafuseError(f"output {out_dir} exists (use --force to replace it)")
    deltas, replace = read_adapter(adapter_dir) if adapter_dir is not None else ({}, {})
    experts = {}  # LoRA on parameters (MoE experts, routers): already in checkpoint names
    if adapter_dir is not None and merge_experts.targets_parameters(Path(adapter_dir)):
        experts = merge_experts.expert_deltas(base_dir, Path(adapter_dir), deltas)
    config = _check_base_config(base_dir, deltas, replace)
    stored = checkpoint_keys(base_dir, config, [*deltas, *replace])
    deltas = {stored[k]: v for k, v in deltas.items()} | experts
    replace = {stored[k]: v for k, v in replace.items()}
    shards = base_shards(base_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # the merged model holds the base's tensors: its size when the dtypes stay (else unknown)
    needed = sum(f.stat().st_size for f in shards) if dtype is None else None
    with files.disk_full_as_error(
        "the merged model", out_dir, needed, "its partial dir was removed"
    ):
        _merge_into(tmp, out_dir, base_dir, shards, deltas, replace, config, dtype,
                    max_shard_size, tokenizer_dir or adapter_dir or base_dir)  # fmt: skip
    return out_dir


def _merge_into(tmp: Path, out_dir: Path, base_dir: Path, shards, deltas, replace, config, dtype,
                max_shard_size, tok_dir) -> None:  # fmt: skip
    """Write the merged shards and side files into ``tmp``, then rename it to ``out_dir``;
    ``tmp`` is removed whatever goes wrong."""
    try:
        writer = _ShardWriter(tmp, parse_size(max_shard_size))
        pending = set(deltas) | set(replace)
        for shard in tqdm(shards, desc="merging shards", unit="shard"):
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    target = dtype or t.dtype
                    if key in deltas:
                        t = deltas[key].apply(t, target)
                    elif key in replace:
                        t = replace[key].to(target)
                    else:
                        t = t.to(target)
                    pending.discard(key)
                    writer.add(key, t)
        if pending:
            raise LorafuseError(
                f"adapter weights with no matching base tensor in {base_dir}: {sorted(pending)[:5]}"
            )
        writer.finish()
        _write_side_files(base_dir, Path(tok_dir), tmp, config, dtype)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_side_files(base_dir: Path, tok_dir: Path, tmp: Path, config: dict, dtype) -> None:
    if dtype is not None:
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    gen = base_dir / "generation_config.json"
    if gen.is_file():
        shutil.copy2(gen, tmp / gen.name)
    else:
        keys = ("bos_token_id", "eos_token_id", "pad_token_id")
        (tmp / gen.name).write_text(
            json.dumps({k: config[k] for k in keys if config.get(k) is not None})
        )
    src = tok_dir if any((tok_dir / f).is_file() for f in TOKENIZER_FILES) else base_dir
    # The marker of a GGUF-converted base travels with its tokenizer: GGUF export reads the
    # source file's pre-tokenizer name from it (export.gguf_pretokenizer).
    names = TOKENIZER_FILES + ((SOURCE_MARKER,) if src == base_dir else ())
    for name in names:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished temp dir into place (replacing an old output only after success)."""
    files.replace_dir(tmp, out_dir)
