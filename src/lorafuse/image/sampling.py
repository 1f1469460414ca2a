"""Sample images during training, from a kohya-style prompts file.

One prompt a line (blank lines and ``#`` comments skipped), with kohya's options after `` --``:
``--n`` negative prompt, ``--w`` / ``--h`` size in px (rounded down to a multiple of 8, at least
64), ``--s`` steps, ``--l`` CFG scale, ``--d`` seed. Defaults: the training resolution, 30 steps,
scale 7.5, seed = training seed + line index.

Images come from a diffusers pipeline assembled from the components in memory (the UNet with the
LoRA network installed, so what is sampled is what is being trained) and a DDIM scheduler built
from the model's noise-schedule config. They are written atomically as
``<samples>/step-<step>-<index>.png`` plus ``step-<step>-grid.png`` (all images of the step in a row).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from lorafuse import files
from lorafuse.errors import LorafuseError


class SamplePromptError(LorafuseError, ValueError):
    """The prompts file cannot be read; names the file and line."""


@dataclass
class SamplePrompt:
    prompt: str
    negative: str = ""
    width: int | None = None
    height: int | None = None
    steps: int = 30
    scale: float = 7.5
    seed: int | None = None


_OPTS = {"n": ("negative", str), "w": ("width", int), "h": ("height", int), "s": ("steps", int),
         "l": ("scale", float), "d": ("seed", int)}  # fmt: skip


def parse_prompt_line(line: str, where: str = "prompt") -> SamplePrompt:
    """``"a cat --n blurry --w 512 --s 20"`` -> :class:`SamplePrompt` (kohya's syntax)."""
    parts = line.split(" --")
    out = SamplePrompt(parts[0].strip())
    for part in parts[1:]:
        m = re.match(r"^([a-z])\s+(.*)$", part.strip(), re.S)
        if not m or m.group(1) not in _OPTS:
            raise SamplePromptError(f"{where}: unknown option --{part.strip()[:20]!r} "
                                    "(known: --n --w --h --s --l --d)")  # fmt: skip
        name, kind = _OPTS[m.group(1)]
        try:
            value = kind(m.group(2).strip())
        except ValueError:
            raise SamplePromptError(f"{where}: --{m.group(1)} needs a {kind.__name__}") from None
        setattr(out, name, value)
    for name in ("width", "height"):
        v = getattr(out, name)
        if v is not None:
            setattr(out, name, max(64, v - v % 8))
    return out


def read_prompts(path: str) -> list[SamplePrompt]:
    if not os.path.isfile(path):
        raise SamplePromptError(f"--sample-prompts {path}: no such file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                prompts.append(parse_prompt_line(line, f"{path}:{i}"))
    if not prompts:
        raise SamplePromptError(f"--sample-prompts {path}: no prompts in it")
    return prompts


def build_pipeline(sd):
    """A diffusers text-to-image pipeline over the in-memory components of ``sd`` (an SDModel)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    sched = DDIMScheduler.from_config(sd.noise_scheduler.config)
    if sd.family == "sdxl":
        te1, te2 = sd.text_encoders
        tok1, tok2 = sd.tokenizers
        return StableDiffusionXLPipeline(vae=sd.vae, text_encoder=te1, text_encoder_2=te2,
                                         tokenizer=tok1, tokenizer_2=tok2, unet=sd.unet,
                                         scheduler=sched)  # fmt: skip
    return StableDiffusionPipeline(vae=sd.vae, text_encoder=sd.text_encoders[0],
                                   tokenizer=sd.tokenizers[0], unet=sd.unet, scheduler=sched,
                                   safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)  # fmt: skip


def _save_png(image, path: str) -> None:
    with files.atomic_path(path) as tmp:
        image.save(tmp)


def make_grid(images):
    """All images in one row, each in a cell of the largest width x height."""
    from PIL import Image

    w = max(im.width for im in images)
    h = max(im.height for im in images)
    grid = Image.new("RGB", (w * len(images), h))
    for i, im in enumerate(images):
        grid.paste(im, (i * w, 0))
    return grid


@torch.no_grad()
def sample_images(trainer, out_dir: str, step: int) -> list[str]:
    """Generate every prompt of ``trainer.cfg.sample_prompts``; returns the PNG paths (grid last).

    ``trainer`` is an :class:`~lorafuse.image.trainer.ImageTrainer` (its ``sd``, ``cfg``,
    ``device`` and autocast). Random numbers come from per-prompt generators only.
    """
    cfg = trainer.cfg
    prompts = read_prompts(cfg.sample_prompts)
    pipe = build_pipeline(trainer.sd)
    pipe.set_progress_bar_config(disable=True)
    os.makedirs(out_dir, exist_ok=True)
    paths, images = [], []
    for i, p in enumerate(prompts):
        g = torch.Generator(trainer.device).manual_seed(
            p.seed if p.seed is not None else cfg.seed + i
        )
        with trainer.autocast():
            image = pipe(prompt=p.prompt, negative_prompt=p.negative or None,
                         width=p.width or cfg.resolution, height=p.height or cfg.resolution,
                         num_inference_steps=p.steps, guidance_scale=p.scale, generator=g,
                         output_type="pil").images[0]  # fmt: skip
        path = os.path.join(out_dir, f"step-{step:06d}-{i:02d}.png")
        _save_png(image, path)
        paths.append(path)
        images.append(image)
    grid = os.path.join(out_dir, f"step-{step:06d}-grid.png")
    _save_png(make_grid(images), grid)
    return paths + [grid]
