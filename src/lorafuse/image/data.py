"""Image folders the kohya way: ``N_concept`` repeat folders, caption sidecars, aspect-ratio buckets.

Layout: ``<data>/<N>_<concept>/`` holds images (png jpg jpeg webp bmp), each with a caption sidecar
of the same stem (``.txt``, else ``.caption``, or ``caption_extension``); every image counts ``N``
times per epoch. A caption's first line is the caption (as kohya reads it).

Buckets (kohya's ``BucketManager``): with bucketing on, the candidate resolutions are every
``(w, h)`` with sides in ``[min, max]`` in steps of ``bucket_reso_steps`` and area at most
``resolution^2``; an image gets the bucket whose aspect ratio is nearest its own, is resized to cover
it and center-cropped. With ``bucket_no_upscale`` an image smaller than ``resolution^2`` keeps its own
size (rounded down to the step); larger ones are scaled down to that area. Without bucketing every
image is resized to cover ``resolution x resolution`` and center-cropped.

Batches hold images of one bucket. An epoch's order (shuffle within each bucket, cut into batches,
shuffle the batches) and each caption's tag shuffle / dropout come from generators seeded by
``(seed, epoch, ...)``, never the global RNG: a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from lorafuse.errors import LorafuseError
from lorafuse.train.config import ConfigError

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_EXTS = (".txt", ".caption")
_FOLDER_RE = re.compile(r"^(\d+)_(.+)$")


class ImageDataError(LorafuseError, ValueError):
    """The image folder cannot be used as given; the message names the folder or file."""


@dataclass
class ImageItem:
    """One image: where it is, its caption, repeats, original size and bucket (all in px, (w, h))."""

    path: str
    caption: str
    concept: str  # the folder name (``N_concept``)
    repeats: int
    size: tuple[int, int]
    bucket: tuple[int, int] = (0, 0)


# ---- scanning ------------------------------------------------------------------------------------
def _read_caption(image_path: str, exts: tuple[str, ...]) -> str | None:
    stem = os.path.splitext(image_path)[0]
    for ext in exts:
        path = stem + ext
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
            return lines[0].strip() if lines else ""
    return None


def _image_size(path: str) -> tuple[int, int]:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except Exception as err:  # PIL.UnidentifiedImageError, OSError: truncated / not an image
        raise ImageDataError(f"{path}: cannot read the image ({err})") from None


def scan_folder(
    root: str, caption_extension: str | None = None, caption_from_folder: bool = False
) -> list[ImageItem]:
    """Every image under ``root``'s ``N_concept`` folders, with caption and repeats (sorted)."""
    if not root or not os.path.isdir(root):
        raise ImageDataError(f"--data {root!r}: no such folder")
    exts = (caption_extension,) if caption_extension else CAPTION_EXTS
    folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    folders = [d for d in folders if not d.startswith(".")]  # e.g. a cache dir
    loose = [f for f in os.listdir(root) if f.lower().endswith(IMAGE_EXTS)]
    if not folders:
        what = f"{len(loose)} images directly in it" if loose else "nothing"
        raise ImageDataError(
            f"--data {root}: no N_concept folders ({what}); put the images in a folder named "
            "like 10_mychar (10 = repeats per epoch)"
        )
    items: list[ImageItem] = []
    missing: list[str] = []
    for name in folders:
        m = _FOLDER_RE.match(name)
        if not m or int(m.group(1)) < 1:
            raise ImageDataError(
                f"{os.path.join(root, name)}: folder name must be N_concept with N >= 1 repeats "
                "(e.g. 10_mychar)"
            )
        repeats, concept_words = int(m.group(1)), m.group(2)
        folder = os.path.join(root, name)
        files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTS))
        if not files:
            raise ImageDataError(f"{folder}: no images ({', '.join(IMAGE_EXTS)})")
        for file in files:
            path = os.path.join(folder, file)
            caption = _read_caption(path, exts)
            if caption is None:
                if not caption_from_folder:
                    missing.append(path)
                    continue
                caption = concept_words  # kohya's class tokens
            items.append(ImageItem(path, caption, name, repeats, _image_size(path)))
    if missing:
        raise ImageDataError(
            f"{len(missing)} image(s) have no caption file ({' or '.join(exts)}), e.g. "
            f"{', '.join(missing[:3])}; add captions, or pass --caption-from-folder to use the "
            "folder's concept name"
        )
    return items


def tag_frequency(items: list[ImageItem]) -> dict[str, dict[str, int]]:
    """``{folder: {tag: count}}`` over the comma-separated tags (kohya's ``ss_tag_frequency``)."""
    out: dict[str, Counter] = {}
    for it in items:
        tags = [t.strip() for t in it.caption.split(",") if t.strip()]
        out.setdefault(it.concept, Counter()).update(tags)
    return {k: dict(v) for k, v in out.items()}


# ---- buckets ---------------------------------------------------------------------------------------
def bucket_resolutions(
    resolution: int, min_size: int, max_size: int, step: int
) -> list[tuple[int, int]]:
    """kohya's ``make_bucket_resolutions``: (w, h) pairs, sides in [min, max] by ``step``, area <=
    resolution^2, plus the square."""
    max_area = resolution * resolution
    side = int(math.sqrt(max_area) // step) * step
    resos = {(side, side)}
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // step) * step)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += step
    return sorted(resos)


def _round_to_step(x: float, step: int) -> int:
    x = int(x + 0.5)
    return x - x % step


def select_bucket(
    size: tuple[int, int], resos: list[tuple[int, int]] | None, resolution: int, step: int
) -> tuple[int, int]:
    """The bucket of an image of ``size``: nearest aspect ratio among ``resos``, or (``resos`` None:
    no upscale) its own size scaled down to ``resolution^2`` at most, rounded down to ``step``."""
    w, h = size
    ar = w / h
    if resos is not None:
        ratios = np.array([bw / bh for bw, bh in resos])
        return resos[int(np.abs(ratios - ar).argmin())]
    max_area = resolution * resolution
    if w * h > max_area:  # scale down keeping the aspect ratio (kohya's two candidate roundings)
        rw = math.sqrt(max_area * ar)
        rh = max_area / rw
        bw = _round_to_step(rw, step)
        ar_w = bw / _round_to_step(bw / ar, step)
        bh = _round_to_step(rh, step)
        ar_h = _round_to_step(bh * ar, step) / bh
        w, h = (
            (bw, int(bw / ar + 0.5))
            if abs(ar_w - ar) < abs(ar_h - ar)
            else (int(bh * ar + 0.5), bh)
        )
    bucket = (w - w % step, h - h % step)
    if min(bucket) < step:
        raise ImageDataError(
            f"image of {size[0]}x{size[1]} px is smaller than one bucket step {step}"
        )
    return bucket


def assign_buckets(items: list[ImageItem], cfg) -> list[tuple[int, int]]:
    """Set every item's bucket per ``cfg`` (an ImageTrainConfig); return the buckets in use."""
    res = cfg.resolution
    if cfg.enable_bucket and not cfg.min_bucket_reso <= res <= cfg.max_bucket_reso:
        raise ConfigError(
            f"resolution={res}: with enable_bucket it must lie between min_bucket_reso="
            f"{cfg.min_bucket_reso} and max_bucket_reso={cfg.max_bucket_reso}"
        )
    if not cfg.enable_bucket:
        resos, step = [(res, res)], 8
    elif cfg.bucket_no_upscale:
        resos, step = None, cfg.bucket_reso_steps
    else:
        step = cfg.bucket_reso_steps
        resos = bucket_resolutions(res, cfg.min_bucket_reso, cfg.max_bucket_reso, step)
    for it in items:
        it.bucket = select_bucket(it.size, resos, res, step)
    return sorted({it.bucket for it in items})


def crop_box(size: tuple[int, int], bucket: tuple[int, int]) -> tuple[tuple[int, int], int, int]:
    """``((resized w, h), crop_top, crop_left)``: scale to cover the bucket, then center-crop."""
    w, h = size
    bw, bh = bucket
    scale = max(bw / w, bh / h)
    rw, rh = max(bw, int(w * scale + 0.5)), max(bh, int(h * scale + 0.5))
    return (rw, rh), (rh - bh) // 2, (rw - bw) // 2


def load_image(item: ImageItem) -> tuple[torch.Tensor, tuple[int, int]]:
    """The item as a (3, bh, bw) float tensor in [-1, 1] and its (crop_top, crop_left) in px."""
    from PIL import Image

    try:
        with Image.open(item.path) as im:
            im = im.convert("RGB")
            (rw, rh), top, left = crop_box(im.size, item.bucket)
            if (rw, rh) != im.size:
                im = im.resize((rw, rh), Image.Resampling.LANCZOS)
            bw, bh = item.bucket
            im = im.crop((left, top, left + bw, top + bh))
            arr = np.asarray(im, dtype=np.float32)  # (bh, bw, 3) in [0, 255]
    except ImageDataError:
        raise
    except Exception as err:
        raise ImageDataError(f"{item.path}: cannot read the image ({err})") from None
    pixels = torch.from_numpy(arr).permute(2, 0, 1) / 127.5 - 1.0  # (3, bh, bw)
    return pixels.contiguous(), (top, left)


# ---- epochs and captions ---------------------------------------------------------------------------
def _gen(*keys: int) -> torch.Generator:
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + int(k)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def epoch_batches(
    items: list[ImageItem], batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """The epoch's batches of item indices: each item ``repeats`` times, one bucket per batch."""
    g = _gen(seed, epoch, 1)
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for i, it in enumerate(items):
        by_bucket.setdefault(it.bucket, []).extend([i] * it.repeats)
    batches: list[list[int]] = []
    for bucket in sorted(by_bucket):
        idx = by_bucket[bucket]
        order = torch.randperm(len(idx), generator=g).tolist()
        idx = [idx[j] for j in order]
        batches += [idx[s : s + batch_size] for s in range(0, len(idx), batch_size)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[j] for j in order]


def steps_per_epoch(items: list[ImageItem], batch_size: int) -> int:
    counts: Counter = Counter()
    for it in items:
        counts[it.bucket] += it.repeats
    return sum(math.ceil(n / batch_size) for n in counts.values())


def process_caption(
    caption: str, *, shuffle: bool, keep_tokens: int, dropout_rate: float, g: torch.Generator
) -> str:
    """Caption dropout (whole caption -> ""), then shuffle the tags after the first ``keep_tokens``."""
    if dropout_rate > 0 and float(torch.rand((), generator=g)) < dropout_rate:
        return ""
    if not shuffle:
        return caption
    tags = [t.strip() for t in caption.split(",")]
    kept, rest = tags[:keep_tokens], tags[keep_tokens:]
    rest = [rest[j] for j in torch.randperm(len(rest), generator=g).tolist()]
    return ", ".join(kept + rest)


def batch_captions(
    items: list[ImageItem], idx: list[int], cfg, epoch: int, batch_no: int
) -> list[str]:
    """The captions of one batch as trained (seeded by epoch and batch: resumable)."""
    g = _gen(cfg.seed, epoch, batch_no, 2)
    return [
        process_caption(items[i].caption, shuffle=cfg.shuffle_caption, keep_tokens=cfg.keep_tokens,
                        dropout_rate=cfg.caption_dropout_rate, g=g)
        for i in idx
    ]  # fmt: skip
