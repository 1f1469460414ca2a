"""The kohya LoRA file: names, tensors and metadata as sd-scripts writes them.

A file holds, per adapted layer, ``<name>.lora_down.weight`` (r, in) or (r, Cin, kh, kw),
``<name>.lora_up.weight`` (out, r) or (Cout, r, 1, 1) and ``<name>.alpha`` (0-dim), fp16 by
default, plus string metadata (``ss_*`` for the A1111/ComfyUI/kohya GUIs, ``modelspec.*``,
``sshs_*`` hashes). Names (sd-scripts ``networks/lora.py``: prefix + module path, '.' -> '_'):

* SD1.x/2.x UNet: ``lora_unet_`` + the diffusers path (kohya trains them on a diffusers-layout
  UNet): ``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q``;
* SDXL UNet: ``lora_unet_`` + the SGM path of kohya's own SDXL UNet (``sdxl_original_unet``):
  ``input_blocks.{1 + b*(L+1) + i}.0|1``, ``middle_block.0|1|2``, ``output_blocks.{b*(L+1) + i}``,
  ResNet ``in_layers.2`` / ``out_layers.3`` / ``emb_layers.1`` / ``skip_connection``, Downsample
  ``op``, Upsample at ``.2.conv`` (``.1.conv`` in a block without attention), L = layers per
  block (2 on SDXL): ``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``;
* text encoders: ``lora_te_`` (SDXL ``lora_te1_`` / ``lora_te2_``) + ``text_model_`` + the CLIP
  path. transformers 5's ``CLIPTextModel`` has no ``text_model`` submodule any more, but
  ComfyUI, A1111 and diffusers match on the name, so it is written whatever the module tree is.

Keys on our side are the network's: ``"<component>:<dotted module path>"`` with component
``unet``, ``te1``, ``te2`` (:mod:`lorafuse.image.network`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafuse import __version__, files
from lorafuse.errors import LorafuseError

FAMILIES = ("sd1", "sd2", "sdxl")
SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".alpha")
TE_PREFIXES = {"sd1": {"te1": "lora_te_"}, "sd2": {"te1": "lora_te_"},
               "sdxl": {"te1": "lora_te1_", "te2": "lora_te2_"}}  # fmt: skip
BASE_MODEL_VERSION = {"sd1": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0"}
# sd-scripts library/sai_model_spec.py
ARCHITECTURE = {
    "sd1": "stable-diffusion-v1",
    "sd2": "stable-diffusion-v2-512",
    "sd2-v": "stable-diffusion-v2-768-v",
    "sdxl": "stable-diffusion-xl-v1-base",
}
IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"
# Identifiers that contain '_' (to read kohya names back without a model): longest match first
_WORDS = {
    tuple(w.split("_"))
    for w in (
        "down_blocks up_blocks mid_block transformer_blocks proj_in proj_out to_q to_k to_v "
        "to_out conv_shortcut time_emb_proj conv_in conv_out conv_norm_out time_embedding "
        "linear_1 linear_2 add_embedding input_blocks middle_block output_blocks in_layers "
        "out_layers emb_layers skip_connection time_embed label_emb text_model self_attn q_proj "
        "k_proj v_proj out_proj final_layer_norm layer_norm1 layer_norm2 text_projection"
    ).split()
}
_RESNET_TO_SGM = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0",
                  "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                  "conv_shortcut": "skip_connection"}  # fmt: skip
_RESNET_FROM_SGM = {v: k for k, v in _RESNET_TO_SGM.items()}
_TOP_TO_SGM = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_TOP_FROM_SGM = {v: k for k, v in _TOP_TO_SGM.items()}


class LoRAFileError(LorafuseError, ValueError):
    """A LoRA file or state dict that is not a kohya LoRA we can read (names the key/file)."""


@dataclass(frozen=True)
class UNetLayout:
    """What the SGM numbering depends on: ResNets per down block, and which up blocks have
    attention (their Upsample sits at index 2, else 1). Defaults: SDXL base."""

    layers_per_block: int = 2
    up_attention: tuple[bool, ...] = (True, True, False)

    @classmethod
    def from_config(cls, config) -> UNetLayout:
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
        return cls(
            int(get("layers_per_block")),
            tuple("CrossAttn" in t for t in get("up_block_types")),
        )


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise LoRAFileError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")


# ---- UNet paths: diffusers <-> SGM (SDXL) ---------------------------------------------------


def unet_to_sgm(path: str, layout: UNetLayout = UNetLayout()) -> str:
    """Diffusers UNet module path -> kohya's SDXL (SGM) path (a path outside the blocks and the
    embeddings raises)."""
    L = layout.layers_per_block
    p = path.split(".")
    if path in _TOP_TO_SGM:
        return _TOP_TO_SGM[path]
    if p[0] == "down_blocks" and len(p) >= 4:
        b, kind, i, rest = int(p[1]), p[2], int(p[3]), p[4:]
        if kind == "downsamplers":  # Downsample2D.conv -> op
            return ".".join([f"input_blocks.{1 + b * (L + 1) + L}.0.op"] + rest[1:])
        n = 1 + b * (L + 1) + i
        return _sgm_inner(f"input_blocks.{n}", kind, rest, path)
    if p[0] == "mid_block" and len(p) >= 3:
        kind, i, rest = p[1], int(p[2]), p[3:]
        n = {("resnets", 0): 0, ("attentions", 0): 1, ("resnets", 1): 2}.get((kind, i))
        if n is None:
            raise LoRAFileError(f"UNet path {path!r}: no SGM name for mid_block.{kind}.{i}")
        return _sgm_inner(f"middle_block.{n}", kind, rest, path, sub=False)
    if p[0] == "up_blocks" and len(p) >= 4:
        b, kind, i, rest = int(p[1]), p[2], int(p[3]), p[4:]
        if kind == "upsamplers":
            has_attn = b < len(layout.up_attention) and layout.up_attention[b]
            return ".".join([f"output_blocks.{b * (L + 1) + L}.{2 if has_attn else 1}"] + rest)
        return _sgm_inner(f"output_blocks.{b * (L + 1) + i}", kind, rest, path)
    raise LoRAFileError(f"UNet path {path!r} has no SGM (SDXL) name")


def _sgm_inner(block: str, kind: str, rest: list[str], path: str, sub: bool = True) -> str:
    """ResNet -> ``<block>.0`` with SGM layer names, transformer -> ``<block>.1`` (the middle
    block's entries have no sub-index)."""
    if kind == "resnets":
        inner, rest = "0", [_RESNET_TO_SGM.get(rest[0], rest[0]), *rest[1:]] if rest else rest
    elif kind == "attentions":
        inner = "1"
    else:
        raise LoRAFileError(f"UNet path {path!r}: no SGM name for {kind!r}")
    return ".".join([f"{block}.{inner}" if sub else block, *rest])


def sgm_to_unet(path: str, layout: UNetLayout = UNetLayout()) -> str:
    """Inverse of :func:`unet_to_sgm` (kohya's SDXL path -> diffusers path)."""
    L = layout.layers_per_block
    if path in _TOP_FROM_SGM:
        return _TOP_FROM_SGM[path]
    p = path.split(".")
    bad = LoRAFileError(f"SDXL UNet path {path!r} is not in kohya's SGM layout")
    if len(p) < 3 or not p[1].isdigit():
        raise bad
    n = int(p[1])
    if p[0] == "input_blocks" and n >= 1 and p[2].isdigit():
        b, i = divmod(n - 1, L + 1)
        if p[2] == "0" and len(p) > 3 and p[3] == "op":
            return ".".join([f"down_blocks.{b}.downsamplers.0.conv"] + p[4:])
        return _diffusers_inner(f"down_blocks.{b}", i, p[2], p[3:], bad)
    if p[0] == "middle_block" and n in (0, 1, 2):
        kind = "attentions.0" if n == 1 else f"resnets.{n // 2}"
        rest = p[2:]
        if kind.startswith("resnets") and rest:
            rest = _resnet_from_sgm(rest)
        return ".".join([f"mid_block.{kind}"] + rest)
    if p[0] == "output_blocks" and p[2].isdigit():
        b, i = divmod(n, L + 1)
        if p[2] in ("1", "2") and len(p) > 3 and p[3] == "conv":  # Upsample2D (.1 without attn)
            return ".".join([f"up_blocks.{b}.upsamplers.0"] + p[3:])
        return _diffusers_inner(f"up_blocks.{b}", i, p[2], p[3:], bad)
    raise bad


def _resnet_from_sgm(rest: list[str]) -> list[str]:
    two = ".".join(rest[:2])
    if two in _RESNET_FROM_SGM:
        return [_RESNET_FROM_SGM[two]] + rest[2:]
    if rest[0] in _RESNET_FROM_SGM:  # skip_connection
        return [_RESNET_FROM_SGM[rest[0]]] + rest[1:]
    return rest


def _diffusers_inner(block: str, i: int, inner: str, rest: list[str], bad: Exception) -> str:
    if inner == "0":
        return ".".join([f"{block}.resnets.{i}"] + _resnet_from_sgm(rest))
    if inner == "1":
        return ".".join([f"{block}.attentions.{i}"] + rest)
    raise bad


# ---- names ----------------------------------------------------------------------------------


def kohya_name(key: str, family: str, layout: UNetLayout = UNetLayout()) -> str:
    """``"<component>:<dotted path>"`` -> kohya LoRA name (no suffix)."""
    _check_family(family)
    component, _, path = key.partition(":")
    if component == "unet":
        if family == "sdxl":
            path = unet_to_sgm(path, layout)
        return "lora_unet_" + path.replace(".", "_")
    prefix = TE_PREFIXES[family].get(component)
    if prefix is None or not path:
        raise LoRAFileError(
            f"LoRA key {key!r}: no kohya name for component {component!r} "
            f"on {family} (components: unet, {', '.join(TE_PREFIXES[family])})"
        )
    path = path.removeprefix("text_model.")  # CLIPTextModelWithProjection still nests it
    return prefix + "text_model_" + path.replace(".", "_")


def _dotted(underscored: str) -> str:
    """``down_blocks_0_attentions_0_proj_in`` -> ``down_blocks.0.attentions.0.proj_in``."""
    toks, out, i = underscored.split("_"), [], 0
    while i < len(toks):
        for n in (3, 2, 1):
            if n == 1 or tuple(toks[i : i + n]) in _WORDS:
                out.append("_".join(toks[i : i + n]))
                i += n
                break
    return ".".join(out)


def module_key(name: str, family: str, layout: UNetLayout = UNetLayout()) -> str:
    """kohya LoRA name -> ``"<component>:<dotted path>"`` (inverse of :func:`kohya_name`).

    Reads SDXL UNet names in the SGM layout (kohya's) or the diffusers one, and ``lora_te_`` as
    the first text encoder in every family (as diffusers does). The path of a CLIPTextModel has
    no ``text_model.`` (transformers 5); that of SDXL's CLIPTextModelWithProjection keeps it.
    """
    _check_family(family)
    if name.startswith("lora_unet_"):
        path = _dotted(name[len("lora_unet_") :])
        if family == "sdxl" and path.split(".")[0] in ("input_blocks", "middle_block",
                                                       "output_blocks", "time_embed",
                                                       "label_emb", "out"):  # fmt: skip
            path = sgm_to_unet(path, layout)
        return f"unet:{path}"
    for component, prefix in [("te1", "lora_te_"), *TE_PREFIXES[family].items()]:
        if name.startswith(prefix + "text_model_"):
            path = _dotted(name[len(prefix + "text_model_") :])
            return f"{component}:{'text_model.' if component == 'te2' else ''}{path}"
    raise LoRAFileError(
        f"LoRA name {name!r} is not a kohya {family} name (lora_unet_..., "
        f"{', '.join(p + 'text_model_...' for p in TE_PREFIXES[family].values())})"
    )


# ---- state dicts ----------------------------------------------------------------------------


def to_kohya_state_dict(
    tensors: dict[str, dict],
    family: str,
    dtype: torch.dtype | None = torch.float16,
    layout: UNetLayout = UNetLayout(),
) -> dict[str, torch.Tensor]:
    """Network tensors (key -> {"down", "up", "alpha"}) -> kohya state dict (CPU, ``dtype``;
    None keeps each tensor's own). Conv LoRA stays 4-D: down (r, Cin, kh, kw), up (Cout, r, 1, 1);
    alpha is a 0-dim tensor (kohya's buffer)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        down, up = t["down"].detach().cpu(), t["up"].detach().cpu()
        if down.shape[0] != up.shape[1]:
            raise LoRAFileError(f"{key}: down {tuple(down.shape)} and up {tuple(up.shape)} "
                                "disagree on the rank")  # fmt: skip
        name = kohya_name(key, family, layout)
        if name + ".lora_down.weight" in out:
            raise LoRAFileError(f"{key}: kohya name {name} is already taken by another key")
        alpha = torch.tensor(float(t["alpha"]), dtype=torch.float32)
        for suffix, v in (("lora_down.weight", down), ("lora_up.weight", up), ("alpha", alpha)):
            out[f"{name}.{suffix}"] = (v.to(dtype) if dtype is not None else v).contiguous()
    return out


def from_kohya_state_dict(
    state_dict: dict[str, torch.Tensor],
    family: str,
    layout: UNetLayout = UNetLayout(),
    modules=None,
) -> dict[str, dict]:
    """kohya state dict -> network tensors (key -> {"down", "up", "alpha": float}).

    ``modules`` (optional, e.g. ``LoRANetwork.keys()``): the keys the model has; names are then
    matched exactly against their kohya names, and a name that matches none is an error that
    names it. A missing ``.alpha`` means alpha = rank (kohya's default). Tensors keep their dtype.
    """
    _check_family(family)
    if family != "sdxl" and guess_family(state_dict) == "sdxl":
        raise LoRAFileError(f"this LoRA is for SDXL (lora_te1_/lora_te2_ or SGM UNet names), "
                            f"the model is {family}")  # fmt: skip
    known = {kohya_name(k, family, layout): k for k in modules} if modules is not None else None
    groups: dict[str, dict[str, torch.Tensor]] = {}
    odd = []
    for k, v in state_dict.items():
        suffix = next((s for s in SUFFIXES if k.endswith(s)), None)
        if suffix is None:
            odd.append(k)
            continue
        groups.setdefault(k[: -len(suffix)], {})[suffix] = v
    if odd:
        raise LoRAFileError(
            f"{len(odd)} keys are not kohya LoRA tensors (expected {', '.join(SUFFIXES)}; "
            f"LyCORIS/LoHa/DoRA files are not supported): {', '.join(odd[:5])}"
        )
    out, unmatched = {}, []
    for name, parts in groups.items():
        if ".lora_down.weight" not in parts or ".lora_up.weight" not in parts:
            raise LoRAFileError(f"{name}: needs both .lora_down.weight and .lora_up.weight")
        if known is not None:
            key = known.get(name) or _parsed_key(name, family, layout, known.values())
            if key is None:
                unmatched.append(name)
                continue
        else:
            key = module_key(name, family, layout)
        down, up = parts[".lora_down.weight"], parts[".lora_up.weight"]
        if down.shape[0] != up.shape[1]:
            raise LoRAFileError(f"{name}: lora_down {tuple(down.shape)} and lora_up "
                                f"{tuple(up.shape)} disagree on the rank")  # fmt: skip
        alpha = parts.get(".alpha")
        alpha = float(alpha) if alpha is not None and float(alpha) != 0 else float(down.shape[0])
        out[key] = {"down": down, "up": up, "alpha": alpha}
    if unmatched:
        raise LoRAFileError(
            f"{len(unmatched)} LoRA names match no layer of this {family} model: "
            f"{', '.join(sorted(unmatched)[:5])}{'...' if len(unmatched) > 5 else ''}"
        )
    return out


def _parsed_key(name: str, family: str, layout: UNetLayout, modules) -> str | None:
    """The model's key for a name in another accepted spelling (SDXL diffusers UNet names,
    ``lora_te_`` for te1), or None."""
    try:
        key = module_key(name, family, layout)
    except LoRAFileError:
        return None
    return key if key in set(modules) else None


# ---- files ----------------------------------------------------------------------------------


def model_hashes(state_dict: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, str]:
    """``(sshs_model_hash, sshs_legacy_hash)`` as sd-scripts' ``precalculate_safetensors_hashes``:
    sha256 of the tensor bytes of the file saved with the ``ss_*`` metadata only, and the old
    additional-networks hash (sha256 of 64 KiB at offset 1 MiB, first 8 hex digits)."""
    from safetensors.torch import save

    blob = save(state_dict, {k: v for k, v in metadata.items() if k.startswith("ss_")})
    n = int.from_bytes(blob[:8], "little")
    legacy = hashlib.sha256(blob[0x100000 : 0x100000 + 0x10000]).hexdigest()[:8]
    return hashlib.sha256(blob[8 + n :]).hexdigest(), legacy


def save_lora_file(path, state_dict: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write a kohya ``.safetensors`` atomically (temp file + rename), with ``metadata`` and the
    ``sshs_model_hash``/``sshs_legacy_hash`` kohya adds. Returns the path."""
    from safetensors.torch import save

    path = Path(path)
    bad = {k: type(v).__name__ for k, v in metadata.items() if not isinstance(v, str)}
    if bad:
        raise LoRAFileError(f"safetensors metadata values must be strings: {bad}")
    metadata = dict(metadata)
    metadata["sshs_model_hash"], metadata["sshs_legacy_hash"] = model_hashes(state_dict, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    return files.write_bytes(
        path, save({k: v.contiguous() for k, v in state_dict.items()}, metadata)
    )


def load_lora_file(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a LoRA ``.safetensors``: (state dict on CPU, metadata)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise LoRAFileError(f"LoRA file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            state_dict = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise LoRAFileError(f"{path}: not a readable .safetensors file ({e})") from e
    return state_dict, metadata


def guess_family(state_dict: dict[str, torch.Tensor]) -> str | None:
    """Best guess of the model family a kohya state dict is for (None when it has no hint):
    SDXL files have ``lora_te1_``/``lora_te2_`` or SGM UNet names."""
    names = [k.split(".")[0] for k in state_dict]
    if any(n.startswith(("lora_te1_", "lora_te2_")) or re.match(r"lora_unet_(input|output)_blocks|"
                                                                r"lora_unet_middle_block", n)
           for n in names):  # fmt: skip
        return "sdxl"
    return None


def base_model_hashes(base_model: str) -> dict[str, str]:
    """For a single-file base model, sd-scripts' ``ss_sd_model_hash`` (A1111's old hash: sha256
    of 64 KiB at offset 1 MiB, 8 hex digits) and ``ss_new_sd_model_hash`` (sha256 of the file),
    which A1111 uses to link a LoRA to its checkpoint. Nothing for a diffusers dir."""
    path = Path(base_model) if base_model else None
    if path is None or not path.is_file():
        return {}
    st = path.stat()
    return dict(_file_hashes(str(path.resolve()), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _file_hashes(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    full = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(0x100000)
        legacy = hashlib.sha256(f.read(0x10000)).hexdigest()[:8]
        f.seek(0)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            full.update(chunk)
    return (("ss_sd_model_hash", legacy), ("ss_new_sd_model_hash", full.hexdigest()))


def build_metadata(
    *,
    family: str,
    dim: int,
    alpha: float,
    conv_dim: int | None = None,
    conv_alpha: float | None = None,
    v_parameterization: bool = False,
    resolution: tuple[int, int] = (512, 512),
    num_train_images: int = 0,
    tag_frequency: dict | None = None,
    output_name: str = "lora",
    training_started_at: float | None = None,
    steps: int = 0,
    epoch: int = 0,
    learning_rate: float | None = None,
    unet_lr: float | None = None,
    text_encoder_lr: float | None = None,
    seed: int | None = None,
    mixed_precision: str = "no",
    base_model: str = "",
    extra: dict | None = None,
) -> dict[str, str]:
    """The ``ss_*`` and ``modelspec.*`` metadata sd-scripts writes (values as it formats them:
    ``str()`` of the Python value, JSON for ``ss_network_args``/``ss_tag_frequency``).

    ``ss_base_model_version``: ``sd_v1`` | ``sd_v2`` (+ ``_v`` for v-prediction, as
    ``get_model_version_str_for_sd1_sd2``) | ``sdxl_base_v1-0``. ``tag_frequency``: {folder:
    {tag: count}}. ``extra``: more ``ss_*`` fields (stringified).
    """
    _check_family(family)
    started = time.time() if training_started_at is None else training_started_at
    version = BASE_MODEL_VERSION[family]
    if family != "sdxl" and v_parameterization:
        version += "_v"
    args = {}
    if conv_dim:
        args = {
            "conv_dim": str(conv_dim),
            "conv_alpha": str(conv_alpha if conv_alpha else conv_dim),
        }
    arch = "sd2-v" if family == "sd2" and v_parameterization else family
    meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": dim,
        "ss_network_alpha": alpha,
        "ss_network_args": json.dumps(args),
        "ss_base_model_version": version,
        "ss_v2": family == "sd2",
        "ss_v_parameterization": v_parameterization,
        "ss_sd_model_name": os.path.basename(str(base_model).rstrip("/")),  # as sd-scripts
        **base_model_hashes(base_model),
        "ss_resolution": tuple(resolution),
        "ss_num_train_images": num_train_images,
        "ss_tag_frequency": json.dumps(tag_frequency or {}),
        "ss_output_name": output_name,
        "ss_training_started_at": started,
        "ss_steps": steps,
        "ss_epoch": epoch,
        "ss_learning_rate": learning_rate,
        "ss_unet_lr": unet_lr,
        "ss_text_encoder_lr": text_encoder_lr,
        "ss_seed": seed,
        "ss_mixed_precision": mixed_precision,
        **(extra or {}),
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": ARCHITECTURE[arch] + "/lora",
        # sai_model_spec.determine_implementation: SGM for an SDXL LoRA, diffusers for SD1/2
        "modelspec.implementation": IMPL_STABILITY_AI if family == "sdxl" else "diffusers",
        "modelspec.title": output_name,
        "modelspec.resolution": f"{resolution[0]}x{resolution[1]}",
        "modelspec.prediction_type": "v" if v_parameterization else "epsilon",
        "modelspec.date": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(int(started))),
        "modelspec.implementation_version": f"lorafuse/{__version__}",  # kohya: sd-scripts/<sha>
    }
    return {k: str(v) for k, v in meta.items()}


def read_metadata(metadata: dict[str, str]) -> dict:
    """Parse the fields of :func:`build_metadata` back (JSON fields decoded, numbers typed)."""
    out: dict = dict(metadata)
    for k in ("ss_network_args", "ss_tag_frequency"):
        if k in metadata:
            out[k] = json.loads(metadata[k])
    for k in ("ss_network_dim", "ss_num_train_images", "ss_steps", "ss_epoch"):
        if k in metadata and metadata[k] != "None":
            out[k] = int(metadata[k])
    if metadata.get("ss_network_alpha", "None") != "None":
        out["ss_network_alpha"] = float(metadata["ss_network_alpha"])
    return out
