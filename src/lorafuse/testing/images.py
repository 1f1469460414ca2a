"""Image folders for ``lorafuse train-image`` (kohya's ``N_concept`` layout, captions beside)."""

from __future__ import annotations

import os
from pathlib import Path


def write_image(path: str | os.PathLike, size: tuple[int, int] = (64, 64), seed: int = 0) -> str:
    """A small deterministic RGB image (smooth gradients + a seeded colour blob), any PIL format
    by extension. Returns the path."""
    import numpy as np
    from PIL import Image

    w, h = size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(4, max(5, min(w, h) / 2))
    blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
    base = rng.uniform(0, 1, 3)
    img = np.stack([(base[c] * (xx / w) + (1 - base[c]) * (yy / h)) * 0.6 + blob * rng.uniform(0, 0.4)
                    for c in range(3)], axis=-1)  # fmt: skip
    Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).save(path)
    return str(path)


def make_image_folder(root: str | os.PathLike, concepts: dict[str, list], seed: int = 0) -> str:
    """``concepts``: folder name (``N_concept``) -> list of ``(file name, (w, h), caption or None)``;
    writes each image (:func:`write_image`) and its ``.txt`` caption. Returns ``root``."""
    root = Path(root)
    for i, (folder, images) in enumerate(concepts.items()):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for j, (name, size, caption) in enumerate(images):
            write_image(root / folder / name, size, seed=seed * 1000 + i * 100 + j)
            if caption is not None:
                (root / folder / name).with_suffix(".txt").write_text(caption + "\n")
    return str(root)
