"""Image+text conversations for vision-language models: records, images, tokens, batches.

Record forms (one a line of ``.jsonl``, or a ``.json`` list):

* OpenAI / TRL style: ``messages`` whose ``content`` is a string or a list of parts,
  ``{"type": "text", "text": ...}``, ``{"type": "image", "image": "path or data: URL"}`` or
  ``{"type": "image_url", "image_url": {"url": ...}}``;
* LLaMA-Factory / ms-swift style: string contents with ``<image>`` placeholders and an ``images``
  column listing the images in order (the counts must match).

Relative image paths are relative to the data file. Remote URLs are refused (nothing is fetched).
Each image is converted to RGB and shrunk (aspect kept) to at most ``max_pixels`` pixels before
the model's processor sees it (:mod:`lorafuse.data.vision_rows` tokenizes and batches). Every
problem is a ``DataError("<file>:<line>: ...")``.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from lorafuse.data.formats import ROLES, DataError, LoadStats, read_records
from lorafuse.data.read_options import ReadOptions

PLACEHOLDER = "<image>"
DEFAULT_MAX_PIXELS = 512 * 512


@dataclass
class VisionExample:
    """One conversation: template-form ``messages`` (image parts are ``{"type": "image"}``) and
    the image references in order, resolved against ``base_dir``."""

    source: str
    messages: list[dict]
    images: list = field(default_factory=list)
    base_dir: str = "."


def content_parts(content, where: str) -> tuple[list[dict], list]:
    """OpenAI-style ``content`` (a string or a list of parts) as template parts + image refs."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}], []
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of parts")
    parts, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image" and part.get("image", part.get("path", part.get("url"))):
            parts.append({"type": "image"})
            images.append(part.get("image", part.get("path", part.get("url"))))
        elif kind == "image_url" and isinstance(part.get("image_url"), (dict, str)):
            url = part["image_url"]
            parts.append({"type": "image"})
            images.append(url.get("url") if isinstance(url, dict) else url)
        else:
            raise ValueError(
                f"{where}.content[{j}] must be {{'type': 'text', 'text': ...}}, {{'type': 'image', "
                "'image': path or data URL}} or {'type': 'image_url', 'image_url': {'url': ...}}"
            )
    return parts, images


def _placeholder_parts(text: str) -> list[dict]:
    pieces = text.split(PLACEHOLDER)
    parts = []
    for k, piece in enumerate(pieces):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def normalize_vision(
    record: object, source: str, base_dir: str, need_answer: bool = True
) -> VisionExample:
    """One raw record (either form) as a :class:`VisionExample`; ``ValueError`` if malformed.
    ``need_answer=False``: a prompt for generation (no assistant turn required)."""
    if not isinstance(record, dict):
        raise ValueError(f"record must be a JSON object, got {type(record).__name__}")
    turns = record.get("messages")
    if not isinstance(turns, list) or not turns:
        raise ValueError("a vision-language record needs a non-empty 'messages' list")
    column = record.get("images")
    if column is not None and not isinstance(column, list):
        raise ValueError("'images' must be a list of image paths or data URLs")
    messages, images = [], []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or "content" not in turn:
            raise ValueError(f"{where} must be an object with 'role' in {ROLES} and 'content'")
        content = turn["content"]
        if column is not None and isinstance(content, str):
            parts, refs = _placeholder_parts(content), []
        else:
            parts, refs = content_parts(content, where)
        messages.append({"role": turn["role"], "content": parts})
        images += refs
    if column is not None:
        n = sum(p["type"] == "image" for m in messages for p in m["content"])
        if n != len(column) + len(images):
            raise ValueError(
                f"{n} {PLACEHOLDER} placeholder(s) but {len(column)} image(s) in 'images'"
            )
        images = list(column) + images
    if need_answer and not any(m["role"] == "assistant" for m in messages):
        raise ValueError("conversation has no assistant turn, so nothing to learn")
    return VisionExample(source, messages, images, base_dir)


def read_vision_examples(
    paths: list[str],
    *,
    skip_bad: bool = False,
    stats: LoadStats | None = None,
    options: ReadOptions | None = None,
) -> list[VisionExample]:
    """Every record of ``paths`` as a :class:`VisionExample`, with ``file:line`` errors."""

    def per_file(path: str):
        base = str(Path(path).resolve().parent)

        def normalise(record: object, source: str) -> VisionExample:
            try:
                return normalize_vision(record, source, base)
            except ValueError as err:
                raise DataError(f"{source}: {err}") from None

        return normalise

    return read_records(paths, per_file, what="conversations", skip_bad=skip_bad, stats=stats,
                        options=options)  # fmt: skip


def load_image(ref, base_dir: str | os.PathLike = ".", max_pixels: int | None = None,
               allowed_dir: str | os.PathLike | None = None):  # fmt: skip
    """An RGB PIL image from a path, a ``data:`` URL or a PIL image, at most ``max_pixels``.

    ``allowed_dir``: local files must lie inside it (the server's rule). Raises ``ValueError``
    naming the image; remote URLs are refused (nothing is fetched).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        img = ref
    elif not isinstance(ref, str) or not ref:
        raise ValueError(f"an image must be a path or a data: URL, got {type(ref).__name__}")
    elif ref.startswith(("http://", "https://", "ftp://")):
        raise ValueError(f"remote image URL {ref[:80]!r} refused: lorafuse fetches nothing; "
                         "pass a local file or a data: URL")  # fmt: skip
    elif ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not head.endswith(";base64") or not payload:
            raise ValueError("a data: URL image must be base64 (data:image/png;base64,...)")
        try:
            img = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
            img.load()
        except (binascii.Error, UnidentifiedImageError, OSError) as err:
            raise ValueError(f"data: URL is not a readable image ({err})") from None
    else:
        path = Path(base_dir, ref.removeprefix("file://")).expanduser().resolve()
        if allowed_dir is not None and not path.is_relative_to(Path(allowed_dir).resolve()):
            raise ValueError(f"image {ref!r} is outside the allowed directory {allowed_dir}")
        if not path.is_file():
            raise ValueError(f"image file {path} does not exist")
        try:
            img = Image.open(path)
            img.load()
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"image file {path} is not a readable image ({err})") from None
    return shrink(img.convert("RGB"), max_pixels)


def shrink(img, max_pixels: int | None):
    """``img`` scaled down (aspect kept) to at most ``max_pixels`` pixels; unchanged if within."""
    w, h = img.size
    if not max_pixels or w * h <= max_pixels:
        return img
    s = math.sqrt(max_pixels / (w * h))
    return img.resize((max(1, int(w * s)), max(1, int(h * s))), resample=3)  # 3: bicubic
