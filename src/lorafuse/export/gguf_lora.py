"""Write a PEFT LoRA adapter as its own GGUF, the file llama.cpp's ``--lora`` loads.

The layout is the one llama.cpp's ``convert_lora_to_gguf.py`` writes and
``llama_adapter_lora_init`` checks: ``general.type = adapter``, ``general.architecture`` equal to
the base GGUF's, ``adapter.type = lora``, ``adapter.lora.alpha`` (f32), and per adapted Linear
``<base gguf tensor>.lora_a`` = PEFT ``lora_A.weight`` (r, in) and ``.lora_b`` = ``lora_B.weight``
(out, r). The delta ``B @ A`` must follow every transform the base export makes of its weight:
those are row and column reorderings and splits (the ``llama`` arch's q/k permutation, Qwen3.5's
value-head order, a fused projection split in two), and a reordering ``W[rows][:, cols]`` of
``B @ A`` is ``B[rows] @ A[:, cols]`` (``gguf_layout.gather_of``). A weight the export stacks
with others (per-expert matrices) or changes otherwise is refused.

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
from safetensors import safe_open
from safetensors.torch import load_file

from lorafuse import files
from lorafuse.export.gguf_export import OUTTYPES, convert_tensor
from lorafuse.export.gguf_families import family
from lorafuse.export.gguf_layout import Family, Item, gather_of
from lorafuse.export.gguf_vocab import GGUFExportError
from lorafuse.export.merge import base_shards

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
            if field == "target_parameters":
                raise GGUFExportError(
                    f"{adapter_dir}: LoRA on fused expert parameters (target_parameters="
                    f"{value!r}): llama.cpp can apply LoRA to its stacked expert tensors, but this "
                    "exporter does not convert PEFT's expert-parameter LoRA into them; merge "
                    "instead (--format gguf)"
                )
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


def _base_items(base_dir: Path, fam: Family, config: dict) -> dict[str, list[tuple[Item, list[int]]]]:  # fmt: skip
    """{checkpoint tensor: [(the base export's items made from it, its stored shape)]}."""
    shapes = {}
    for shard in base_shards(base_dir):
        with safe_open(str(shard), framework="pt") as f:
            shapes.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})
    by_source: dict[str, list[tuple[Item, list[int]]]] = {}
    for item in fam.plan(list(shapes), config):
        for key in item.sources:
            by_source.setdefault(key, []).append((item, shapes[key]))
    return by_source


def _gathers(targets: dict, module: str, fam: Family, adapter_dir: Path, cache: dict):
    """[(GGUF tensor, (rows, cols))]: where the delta of ``module`` goes in the base export."""
    items = targets.get(f"{module}.weight", [])
    if not items:
        raise GGUFExportError(f"{adapter_dir}: module {module} has no GGUF {fam.name} tensor")
    out = []
    for item, shape in items:
        gather = gather_of(item, shape, cache)
        if gather is None:
            what = "several checkpoint tensors (stacked experts)" if len(item.sources) > 1 else "a transform of its weight that is not a reordering"  # fmt: skip
            raise GGUFExportError(
                f"{adapter_dir}: {module}: the base GGUF's {item.name} is {what}, so a LoRA "
                "delta cannot follow it into a llama.cpp adapter; merge instead (--format gguf)"
            )
        out.append((item.name, gather))
    return out


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
    fam = family(config)  # the base export's: tensor names and transforms
    cfg, tensors = _adapter_files(adapter_dir)
    _check_config(cfg, adapter_dir)
    pairs = _pairs(tensors, adapter_dir)
    if not pairs:
        raise GGUFExportError(f"{adapter_dir}: no LoRA weights")
    alpha = _alpha(cfg, pairs, adapter_dir)
    targets, cache = _base_items(base_dir, fam, config), {}
    qtype = OUTTYPES[outtype][0]
    plan = []  # (gguf name, numpy array)
    for module, ab in sorted(pairs.items()):
        if module == "lm_head" and (config.get("tie_word_embeddings") or fam.tied_always):
            raise GGUFExportError(
                f"{adapter_dir}: lm_head LoRA on a tied-embedding model: llama.cpp has no separate "
                "output tensor to apply it to; merge instead (--format gguf)"
            )
        a, b = ab["A"].float(), ab["B"].float()
        for gname, (rows, cols) in _gathers(targets, module, fam, adapter_dir, cache):
            for suffix, t in (("lora_a", a[:, cols]), ("lora_b", b[rows])):
                tt = qtype
                if tt == Q.Q8_0 and t.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
                    # lora_b's rows have length r: llama.cpp's converter stores those as f16 too
                    warnings.warn(f"{gname}.{suffix}: row length {t.shape[-1]} not a multiple of "
                                  "32; stored as f16", stacklevel=2)  # fmt: skip
                    tt = Q.F16
                plan.append((f"{gname}.{suffix}", convert_tensor(t.contiguous(), tt), tt))

    out_path.parent.mkdir(parents=True, exist_ok=True)
    needed = sum(data.nbytes for _, data, _ in plan)  # the tensors; the header adds little
    with files.disk_full_as_error(
        "the LoRA GGUF", out_path, needed, "its partial file was removed"
    ):
        with files.atomic_path(out_path) as tmp:
            writer = gguf.GGUFWriter(str(tmp), fam.name)
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
