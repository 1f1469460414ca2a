"""Load a Stable Diffusion model for LoRA training, offline: a diffusers dir, or a single file.

* a diffusers dir (``model_index.json`` + ``unet/ vae/ text_encoder/ tokenizer/ scheduler/``,
  SDXL also ``text_encoder_2/ tokenizer_2/``), each component read with
  ``local_files_only=True``;
* a single-file ``.safetensors`` checkpoint (the original LDM/SGM layout that A1111 and ComfyUI
  use) plus ``model_config``: a local dir in the diffusers layout holding the component configs
  (weights not needed), which diffusers' ``from_single_file`` converts the checkpoint with.
  The hub is never asked for a config.

The family is read from the components: two text encoders -> ``sdxl``; one, with a UNet of
cross-attention width 1024 or linear ``proj_in`` (SD2's OpenCLIP-H UNet) -> ``sd2``; else
``sd1``. The prediction type (``epsilon`` | ``v_prediction``, SD2-768-v) comes from the scheduler
config; training uses a ``DDPMScheduler`` with that config's schedule, as sd-scripts does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorafuse.errors import LorafuseError


class ModelLoadError(LorafuseError, FileNotFoundError):
    """A model path that cannot be loaded: names the path and what is missing or wrong."""


@dataclass
class SDModel:
    """The parts of an SD1.x/2.x/SDXL pipeline that LoRA training needs."""

    family: str  # "sd1" | "sd2" | "sdxl"
    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: list  # [CLIPTextModel] or, SDXL, [CLIPTextModel, CLIPTextModelWithProjection]
    tokenizers: list
    noise_scheduler: object  # DDPMScheduler for training
    prediction_type: str  # "epsilon" | "v_prediction"
    source: str  # the path that was loaded (for metadata)
    scheduler_config: dict = field(default_factory=dict)  # the model's own (for sampling)

    @property
    def v_parameterization(self) -> bool:
        return self.prediction_type == "v_prediction"


REQUIRED = {
    "sd": ("unet", "vae", "text_encoder", "tokenizer", "scheduler"),
    "sdxl": ("unet", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
             "scheduler"),
}  # fmt: skip
PREDICTION_TYPES = ("epsilon", "v_prediction")


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path.parent}: no {path.name} ({what})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable {what} ({e})") from e


def _check_dir(root: Path, *, weights: bool) -> bool:
    """Raise naming every missing component of a diffusers dir; returns is-SDXL."""
    if not root.is_dir():
        raise ModelLoadError(f"model config dir {root} does not exist")
    index = root / "model_index.json"
    sdxl = (root / "text_encoder_2").is_dir()
    if index.is_file():
        sdxl = sdxl or "text_encoder_2" in _read_json(index, "diffusers pipeline index")
    required, missing = REQUIRED["sdxl" if sdxl else "sd"], []
    for comp in required:
        d = root / comp
        if comp.startswith("tokenizer"):
            ok = d.is_dir() and any((d / f).is_file() for f in ("tokenizer.json", "vocab.json"))
        elif comp == "scheduler":
            ok = (d / "scheduler_config.json").is_file()
        else:
            ok = (d / "config.json").is_file()
            if ok and weights:
                ok = any(d.glob("*.safetensors")) or any(d.glob("*.bin"))
        if not ok:
            missing.append(f"{comp}/")
    if missing:
        kind = "diffusers model dir" if weights else "model config dir"
        expected = ", ".join(c + "/" for c in required) + (" with weights" if weights else "")
        raise ModelLoadError(
            f"{root} is not a complete {kind} for SD{'XL' if sdxl else '1.x/2.x'}: missing "
            f"{', '.join(missing)} (expected {expected})"
        )
    return sdxl


def detect_family(unet_config, n_text_encoders: int) -> str:
    """``sdxl`` (two text encoders), ``sd2`` (cross-attention 1024 or linear proj_in), ``sd1``."""
    get = unet_config.get if isinstance(unet_config, dict) else lambda k: getattr(unet_config, k)
    if n_text_encoders == 2:
        return "sdxl"
    if get("cross_attention_dim") == 1024 or get("use_linear_projection"):
        return "sd2"
    return "sd1"


def training_scheduler(scheduler_config: dict, where: str):
    """A ``DDPMScheduler`` on the model's noise schedule (sd-scripts trains with DDPM,
    ``clip_sample=False``); the prediction type is checked."""
    from diffusers import DDPMScheduler

    pred = scheduler_config.get("prediction_type", "epsilon")
    if pred not in PREDICTION_TYPES:
        raise ModelLoadError(f"{where}: prediction_type {pred!r} is not supported "
                             f"(one of {', '.join(PREDICTION_TYPES)})")  # fmt: skip
    return DDPMScheduler.from_config(scheduler_config, clip_sample=False), pred


def load_sd_model(
    model: str,
    model_config: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> SDModel:
    """Load a diffusers dir (``model``) or a single ``.safetensors`` (``model``) with its config
    dir (``model_config``). Never touches the network."""
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model {path} does not exist (a diffusers dir, or a single-file "
                             ".safetensors with --model-config)")  # fmt: skip
    if path.is_dir():
        if model_config is not None:
            raise ModelLoadError(f"--model-config is for single-file checkpoints; {path} is a "
                                 "diffusers dir and carries its own configs")  # fmt: skip
        parts = _load_dir(path, dtype)
        config_root = path
    else:
        if path.suffix != ".safetensors":
            raise ModelLoadError(f"{path}: single-file checkpoints must be .safetensors "
                                 f"(got {path.suffix or 'no extension'}; .ckpt pickles are not "
                                 "loaded)")  # fmt: skip
        if model_config is None:
            raise ModelLoadError(
                f"{path} is a single-file checkpoint: pass --model-config, a local "
                "diffusers-layout dir with the component configs"
            )
        config_root = Path(model_config)
        parts = _load_single_file(path, config_root, dtype)
    sched_cfg = _read_json(config_root / "scheduler" / "scheduler_config.json", "scheduler config")
    noise_scheduler, pred = training_scheduler(sched_cfg, str(config_root))
    unet, vae, tes, toks = parts
    for m in [unet, vae, *tes]:
        m.to(device).eval().requires_grad_(False)
    return SDModel(
        family=detect_family(unet.config, len(tes)), unet=unet, vae=vae, text_encoders=tes,
        tokenizers=toks, noise_scheduler=noise_scheduler, prediction_type=pred,
        source=str(path), scheduler_config=dict(sched_cfg),
    )  # fmt: skip


def _load_dir(root: Path, dtype):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    sdxl = _check_dir(root, weights=True)
    kw = {"local_files_only": True}
    try:
        unet = UNet2DConditionModel.from_pretrained(root, subfolder="unet", torch_dtype=dtype, **kw)
        vae = AutoencoderKL.from_pretrained(root, subfolder="vae", torch_dtype=dtype, **kw)
        tes = [CLIPTextModel.from_pretrained(root / "text_encoder", dtype=dtype, **kw)]
        toks = [CLIPTokenizer.from_pretrained(root / "tokenizer", **kw)]
        if sdxl:
            tes.append(CLIPTextModelWithProjection.from_pretrained(root / "text_encoder_2",
                                                                   dtype=dtype, **kw))  # fmt: skip
            toks.append(CLIPTokenizer.from_pretrained(root / "tokenizer_2", **kw))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{root}: could not load the model ({type(e).__name__}: {e})") from e
    return unet, vae, tes, toks


def _load_single_file(file: Path, config_root: Path, dtype):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    sdxl = _check_dir(config_root, weights=False)
    _check_safetensors(file)
    kw = {"config": str(config_root), "local_files_only": True, "torch_dtype": dtype}
    try:
        if sdxl:
            pipe = StableDiffusionXLPipeline.from_single_file(str(file), **kw)
            return (pipe.unet, pipe.vae, [pipe.text_encoder, pipe.text_encoder_2],
                    [pipe.tokenizer, pipe.tokenizer_2])  # fmt: skip
        pipe = StableDiffusionPipeline.from_single_file(
            str(file), safety_checker=None, feature_extractor=None, **kw
        )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{file}: could not load it as an SD{'XL' if sdxl else ''} "
                             f"single-file checkpoint with configs from {config_root} "
                             f"({type(e).__name__}: {e})") from e  # fmt: skip
    return pipe.unet, pipe.vae, [pipe.text_encoder], [pipe.tokenizer]


def _check_safetensors(file: Path) -> None:
    """Read the header only: a clear error for a file that is not safetensors at all."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{file}: not a readable .safetensors file ({e})") from e
    if not any(k.startswith("model.diffusion_model.") for k in keys):
        raise ModelLoadError(f"{file}: no 'model.diffusion_model.*' tensors; not an original "
                             "SD/SDXL single-file checkpoint (a diffusers dir is loaded by its "
                             "path)")  # fmt: skip
