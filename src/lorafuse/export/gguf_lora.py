"""Write a PEFT LoRA adapter as its own GGUF, the file llama.cpp's ``--lora`` loads.

The layout is the one llama.cpp's ``convert_lora_to_gguf.py`` writes and
``llama_adapter_lora_init`` checks: ``general.type = adapter``, ``general.architecture`` equal to
the base GGUF's, ``adapter.type = lora``, ``adapter.lora.alpha`` (f32), and per adapted Linear
``<base gguf tensor>.lora_a`` = PEFT ``lora_A.weight`` (r, in) and ``.lora_b`` = ``lora_B.weight``
(out, r). For the ``llama`` arch the base export permutes q/k rows (rotate-half -> interleaved);
the delta ``B @ A`` must follow, and a row permutation of ``B @ A`` is the same permutation of
B's rows, so only ``lora_b`` is permuted.

llama.cpp scales every tensor by ``user_scale * alpha / r`` with one alpha per file and r read
from each ``lora_b``; PEFT scales by ``alpha_m / r_m`` (``alpha_m / sqrt(r_m)`` with rsLoRA). So
the file's alpha is ``scaling_m * r_m``, which must be the same for every module: rank_pattern
alone is fine, rsLoRA at one rank is folded into alpha, anything else (per-module alpha) is
refused, as are DoRA, biases, full-weight copies (modules_to_save) and embedding LoRA.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import gguf
from safetensors.torch import load_file

from lorafuse import files
from lorafuse.export.gguf_export import OUTTYPES, convert_tensor
from lorafuse.export.gguf_families import family
from lorafuse.export.gguf_layout import permute_rows
from lorafuse.export.gguf_vocab import GGUFExportError

Q = gguf.GGMLQuantizationType
_PREFIX = "base_model.model."
# LoraConfig options whose effect a GGUF adapter cannot carry: (field, value that is harmless)
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None,
                "trainable_token_indices": None, "layer_replication": None,
                "alora_invocation_tokens": None, "target_parameters": None, "use_qalora": False}  # fmt: skip


def _adapter_files(adapter_dir: Path) -> tuple[dict, dict]:
    cfg_path, weights = (
        adapter_dir / "adapter_config.json",
        adapter_dir / "adapter_model.safetensors",
    )
    if not cfg_path.is_file() or not weights.is_file():
        raise GGUFExportError(
            f"{adapter_dir}: not a PEFT adapter dir (need adapter_config.json and adapter_model.safetensors)"
        )
    return json.loads(cfg_path.read_text()), load_file(str(weights))


def _check_config(cfg: dict, adapter_dir: Path) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise GGUFExportError(f"{adapter_dir}: peft_type {cfg['peft_type']!r}; only LoRA exports")
    for field, harmless in _UNSUPPORTED.items():
        value = cfg.get(field, harmless)
        if value not in (harmless, None, [], {}, False):
            what = "DoRA (use_dora)" if field == "use_dora" else f"{field}={value!r}"
            raise GGUFExportError(
                f"{adapter_dir}: {what} cannot be expressed in a llama.cpp LoRA GGUF; "
                "merge instead (--format gguf)"
            )


def _pairs(tensors: dict, adapter_dir: Path) -> dict[str, dict[str, object]]:
    """{module name: {"A": tensor, "B": tensor}}; anything that is not a Linear LoRA pair raises."""
    pairs: dict[str, dict] = {}
    embedding = next((k for k in tensors if "lora_embedding_" in k), None)
    if embedding:  # PEFT also saves the full embedding then; name the LoRA, not the copy
        raise GGUFExportError(
            f"{adapter_dir}: tensor {embedding}: embedding LoRA is not supported by this writer; "
            "merge instead (--format gguf)"
        )
    for key, t in tensors.items():
        name = key.removeprefix(_PREFIX)
        for half in ("A", "B"):
            if name.endswith(f".lora_{half}.weight"):
                pairs.setdefault(name.removesuffix(f".lora_{half}.weight"), {})[half] = t
                break
        else:
            if "lora_magnitude_vector" in name:
                why = "DoRA magnitude vector"
            else:
                why = "not a lora_A / lora_B weight (a full-weight copy or bias?)"
            raise GGUFExportError(
                f"{adapter_dir}: tensor {key}: {why}; a llama.cpp LoRA GGUF holds only Linear "
                "lora_a/lora_b pairs; merge instead (--format gguf)"
            )
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise GGUFExportError(f"{adapter_dir}: {module} has lora_{set('AB') - set(ab)} missing")
    return pairs


def _alpha(cfg: dict, pairs: dict, adapter_dir: Path) -> float:
    """The one ``adapter.lora.alpha`` for which llama.cpp's ``alpha / r_m`` equals PEFT's scaling."""
    from peft.utils.other import get_pattern_key

    alphas = {}
    for module, ab in pairs.items():
        r = ab["A"].shape[0]
        a = cfg.get("alpha_pattern", {}).get(
            get_pattern_key(cfg.get("alpha_pattern", {}).keys(), module), cfg["lora_alpha"]
        )
        scaling = a / math.sqrt(r) if cfg.get("use_rslora") else a / r
        alphas[module] = scaling * r
    values = sorted(set(round(v, 6) for v in alphas.values()))
    if len(values) > 1:
        lo, hi = min(alphas, key=alphas.get), max(alphas, key=alphas.get)
        raise GGUFExportError(
            f"{adapter_dir}: per-module LoRA scaling (alpha_pattern, or rsLoRA with rank_pattern): "
            f"{lo} needs alpha {alphas[lo]:g}, {hi} needs {alphas[hi]:g}, and a llama.cpp adapter "
            "has one alpha; merge instead (--format gguf)"
        )
    return float(next(iter(alphas.values())))


def write_lora_gguf(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike,
                    out_path: str | os.PathLike, outtype: str = "f32", name: str | None = None,
                    overwrite: bool = False) -> Path:  # fmt: skip
    """Write the PEFT adapter in ``adapter_dir`` (trained on the HF model ``base_dir``) as a GGUF
    adapter for that model's GGUF export; every check runs before anything is written."""
    base_dir, adapter_dir, out_path = Path(base_dir), Path(adapter_dir), Path(out_path)
    if out_path.suffix != ".gguf":
        raise GGUFExportError(f"--output {out_path}: a GGUF file name must end in .gguf")
    if out_path.exists() and not overwrite:
        raise GGUFExportError(f"output {out_path} exists (use --force to replace it)")
    if outtype not in OUTTYPES:
        raise GGUFExportError(
            f"GGUF outtype {outtype!r} not supported; choose one of {sorted(OUTTYPES)}"
        )
    config = json.loads((base_dir / "config.json").read_text())
    fam = family(config)  # the base export's: tensor names and q/k row order
    arch, permuted = fam.name, fam.permute_qk
    cfg, tensors = _adapter_files(adapter_dir)
    _check_config(cfg, adapter_dir)
    pairs = _pairs(tensors, adapter_dir)
    if not pairs:
        raise GGUFExportError(f"{adapter_dir}: no LoRA weights")
    alpha = _alpha(cfg, pairs, adapter_dir)
    names = gguf.get_tensor_name_map(fam.arch, config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    qtype = OUTTYPES[outtype][0]
    plan = []  # (gguf name, numpy array)
    for module, ab in sorted(pairs.items()):
        if module == "lm_head" and (config.get("tie_word_embeddings") or fam.tied_always):
            raise GGUFExportError(
                f"{adapter_dir}: lm_head LoRA on a tied-embedding model: llama.cpp has no separate "
                "output tensor to apply it to; merge instead (--format gguf)"
            )
        gname = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if gname is None:
            raise GGUFExportError(f"{adapter_dir}: module {module} has no GGUF {arch} tensor name")
        a, b = ab["A"].float(), ab["B"].float()
        if gname.endswith("attn_q.weight") and permuted:
            b = permute_rows(b, heads)
        elif gname.endswith("attn_k.weight") and permuted:
            b = permute_rows(b, kv_heads)
        for suffix, t in (("lora_a", a), ("lora_b", b)):
            tt = qtype
            if tt == Q.Q8_0 and t.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
                # lora_b's rows have length r: llama.cpp's converter stores those as f16 too
                warnings.warn(f"{gname}.{suffix}: row length {t.shape[-1]} not a multiple of 32; "
                              "stored as f16", stacklevel=2)  # fmt: skip
                tt = Q.F16
            plan.append((f"{gname}.{suffix}", convert_tensor(t, tt), tt))

    out_path.parent.mkdir(parents=True, exist_ok=True)
    needed = sum(data.nbytes for _, data, _ in plan)  # the tensors; the header adds little
    with files.disk_full_as_error(
        "the LoRA GGUF", out_path, needed, "its partial file was removed"
    ):
        with files.atomic_path(out_path) as tmp:
            writer = gguf.GGUFWriter(str(tmp), arch)
            try:
                writer.add_type(gguf.GGUFType.ADAPTER)
                writer.add_name(name or adapter_dir.name)
                writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
                writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
                for gname, data, tt in plan:
                    writer.add_tensor(gname, data, raw_dtype=None if tt in (Q.F32, Q.F16) else tt)
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
            finally:
                writer.close()
    return out_path
