"""Latent and text-encoder-output caches: encode once, train many steps.

Latents (``cache_latents``): every image is VAE-encoded once at its bucket size, in memory, or
(``cache_latents_to_disk``) in a safetensors file next to the image, ``<image file>.lorafuse-latents
.safetensors``, reused by later runs. A file is used only when its stored key matches:
sha256 of the image file's bytes, the bucket, and the VAE's identity (config + weights), so an
edited image, another resolution/bucket or another VAE rebuilds it. The stored latent is one draw
of the VAE's posterior, seeded by the image's hash and bucket (the same image always gives the same
latent, in memory or on disk: reuse is exact), already scaled by the VAE's ``scaling_factor`` (minus ``shift_factor`` where the VAE has
one), fp32, shape (C, h, w) with h, w = bucket / the VAE's downsampling factor.

Text-encoder outputs (``cache_text_encoder_outputs``, memory only): one entry per distinct caption,
valid only while the captions are fixed (no shuffle, no dropout) and the text encoders frozen;
:class:`~lorafuse.image.config.ImageTrainConfig` refuses the combination otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import torch

from lorafuse import files
from lorafuse.image.data import ImageItem, load_image

CACHE_SUFFIX = ".lorafuse-latents.safetensors"
_FORMAT = "lorafuse-latents-v1"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@torch.no_grad()
def vae_identity(vae) -> str:
    """sha256 of the VAE's config and every weight's bytes (what the latents depend on)."""
    h = hashlib.sha256(json.dumps(dict(vae.config), sort_keys=True, default=str).encode())
    for name, t in vae.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def scale_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's latent normalisation, as diffusers' pipelines undo it before decoding."""
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        latents = latents - shift
    return latents * vae.config.scaling_factor


@torch.no_grad()
def encode_pixels(vae, pixels: torch.Tensor, generator: torch.Generator | None = None):
    """(B, 3, H, W) in [-1, 1] -> scaled latents (B, C, H/f, W/f) fp32: one posterior sample."""
    dev = next(vae.parameters()).device
    dist = vae.encode(pixels.to(dev, next(vae.parameters()).dtype)).latent_dist
    noise = torch.randn(dist.mean.shape, generator=generator, dtype=dist.mean.dtype)
    latents = dist.mean + dist.std * noise.to(dist.mean.device)
    return scale_latents(vae, latents).float()


def cache_path(item: ImageItem) -> str:
    return item.path + CACHE_SUFFIX


def latent_key(content_hash: str, bucket: tuple[int, int], vae_id: str) -> str:
    raw = f"{_FORMAT}|{content_hash}|{bucket[0]}x{bucket[1]}|{vae_id}"
    return hashlib.sha256(raw.encode()).hexdigest()


class LatentCache:
    """Latents and crop offsets of every item, by index (see the module docstring).

    ``stats``: how many latents were ``encoded`` and how many ``reused`` from disk.
    """

    def __init__(self, vae, items: list[ImageItem], *, to_disk: bool, progress: bool = True):
        from safetensors import safe_open
        from safetensors.torch import save_file

        self.latents: list[torch.Tensor] = []
        self.crops: list[tuple[int, int]] = []
        self.stats = {"encoded": 0, "reused": 0}
        vae_id = vae_identity(vae) if to_disk else ""
        from tqdm.auto import tqdm

        for item in tqdm(items, desc="caching latents", unit="img", disable=not progress):
            content = file_sha256(item.path)
            key = latent_key(content, item.bucket, vae_id)
            path = cache_path(item)
            if to_disk and os.path.isfile(path):
                try:
                    with safe_open(path, framework="pt") as f:
                        meta = f.metadata() or {}
                        if meta.get("key") == key:
                            self.latents.append(f.get_tensor("latents"))
                            self.crops.append((int(meta["crop_top"]), int(meta["crop_left"])))
                            self.stats["reused"] += 1
                            continue
                except Exception:  # a damaged cache file: rebuilt below
                    pass
            pixels, crop = load_image(item)
            # the draw depends on the image and bucket only: memory and disk caches agree
            g = torch.Generator().manual_seed(int(latent_key(content, item.bucket, "")[:15], 16))
            latents = encode_pixels(vae, pixels[None], generator=g)[0].cpu()  # (C, h, w)
            self.latents.append(latents)
            self.crops.append(crop)
            self.stats["encoded"] += 1
            if to_disk:
                meta = {"key": key, "crop_top": str(crop[0]), "crop_left": str(crop[1]),
                        "bucket": f"{item.bucket[0]}x{item.bucket[1]}", "format": _FORMAT}  # fmt: skip
                with files.atomic_path(path) as tmp:
                    save_file({"latents": latents.contiguous()}, str(tmp), metadata=meta)

    def batch(self, idx: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(B, C, h, w) latents and the crops of items ``idx`` (one bucket)."""
        return torch.stack([self.latents[i] for i in idx]), [self.crops[i] for i in idx]


class TextEncoderCache:
    """Text-encoder outputs per caption, computed once by ``encode(list[str]) -> tuple of (B, ...)
    tensors`` (SD: (hidden,), SDXL: (hidden, pooled))."""

    def __init__(self, captions: list[str], encode: Callable, batch_size: int = 8):
        self.entries: dict[str, tuple[torch.Tensor, ...]] = {}
        unique = sorted(set(captions))
        for s in range(0, len(unique), batch_size):
            chunk = unique[s : s + batch_size]
            with torch.no_grad():
                outs = encode(chunk)
            for j, cap in enumerate(chunk):
                self.entries[cap] = tuple(o[j].detach() for o in outs)

    def batch(self, captions: list[str]) -> tuple[torch.Tensor, ...]:
        rows = [self.entries[c] for c in captions]
        return tuple(torch.stack(parts) for parts in zip(*rows))
