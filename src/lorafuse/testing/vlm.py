"""Tiny vision-language models on disk for the tests: :mod:`lorafuse.bench.vlm_models`' random
Idefics3 / Qwen2-VL / Qwen2.5-VL over the byte-level chat tokenizer, stock HF dirs of them, an
image+text batch and a generated shapes dataset.
"""

from __future__ import annotations

import os
from pathlib import Path

from lorafuse.bench.vlm_models import COLOURS, FAMILIES, build_vlm, shape_image
from lorafuse.testing.llm import chat_tokenizer

__all__ = ["COLOURS", "FAMILIES", "save_tiny_vlm", "shape_image", "tiny_vlm", "vlm_batch",
           "write_shape_data"]  # fmt: skip


def tiny_vlm(family: str, seed: int = 0, scale: float = 1.0, size: str = "tiny"):
    """``(model, processor)``: :func:`build_vlm` over the byte-level chat tokenizer."""
    return build_vlm(family, chat_tokenizer(), seed, scale, size)


def save_tiny_vlm(path: str | os.PathLike, family: str = "idefics3", seed: int = 0, scale=1.0):
    """Write a tiny random ``family`` VLM + processor as a stock HF dir; returns (model, processor)."""
    model, processor = tiny_vlm(family, seed, scale)
    model.save_pretrained(Path(path))
    processor.save_pretrained(Path(path))
    return model, processor


def vlm_batch(processor, colours=("red", "blue")) -> dict:
    """One padded image+text batch with labels on the answers (assistant tokens only)."""
    from lorafuse.data.vision_rows import collate, encode_conversation

    rows = []
    for c in colours:
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": c}]},
        ]
        rows.append(encode_conversation(processor, messages, [shape_image(c)], source="batch"))
    return collate(rows, processor.tokenizer.pad_token_id)


def write_shape_data(root: str | os.PathLike, n: int, seed: int = 0, name: str = "shapes") -> str:
    """``n`` generated images of one coloured square or circle (random size and place) and a
    ``<name>.jsonl`` asking for the colour (content-part form, image paths relative); returns it."""
    import json
    import random

    from PIL import Image, ImageDraw

    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        colour = rng.choice(COLOURS)
        img = Image.new("RGB", (rng.randint(40, 64), rng.randint(40, 64)), "white")
        w, h = img.size
        s = rng.randint(14, min(w, h) - 4)
        x, y = rng.randint(0, w - s), rng.randint(0, h - s)
        shape = ImageDraw.Draw(img).ellipse if rng.random() < 0.5 else ImageDraw.Draw(img).rectangle
        shape((x, y, x + s, y + s), fill=colour)
        rel = f"images/{name}_{i}.png"
        img.save(root / rel)
        user = [{"type": "image", "image": rel}, {"type": "text", "text": "What colour is it?"}]
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": colour}]
        lines.append(json.dumps({"messages": msgs}))
    path = root / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)
