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
from pathlib import Path

import torch

from lorafuse import __version__, files
from lorafuse.image.kohya_names import (
    DEFAULT_LAYOUT,
    LoRAFileError,
    UNetLayout,
    check_family,
    kohya_name,
    module_key,
)

SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".alpha")
BASE_MODEL_VERSION = {"sd1": "sd_v1", "sd2": "sd_v2", "sdxl": "sdxl_base_v1-0"}
# sd-scripts library/sai_model_spec.py
ARCHITECTURE = {
    "sd1": "stable-diffusion-v1",
    "sd2": "stable-diffusion-v2-512",
    "sd2-v": "stable-diffusion-v2-768-v",
    "sdxl": "stable-diffusion-xl-v1-base",
}
IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"


def to_kohya_state_dict(
    tensors: dict[str, dict],
    family: str,
    dtype: torch.dtype | None = torch.float16,
    layout: UNetLayout = DEFAULT_LAYOUT,
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
    layout: UNetLayout = DEFAULT_LAYOUT,
    modules=None,
) -> dict[str, dict]:
    """kohya state dict -> network tensors (key -> {"down", "up", "alpha": float}).

    ``modules`` (optional, e.g. ``LoRANetwork.keys()``): the keys the model has; names are then
    matched exactly against their kohya names, and a name that matches none is an error that
    names it. A missing ``.alpha`` means alpha = rank (kohya's default). Tensors keep their dtype.
    """
    check_family(family)
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
    check_family(family)
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
