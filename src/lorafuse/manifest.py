"""Checkpoint manifests: the size and SHA-256 of every file in a checkpoint directory.

A trainer writes ``lorafuse_manifest.json`` as the last file of a checkpoint, inside the temp dir
that is then renamed into place, so a checkpoint under its real name always has one. Whoever reads
a checkpoint (``--resume``, ``--checkpoint`` of export / merge / chat / infer / serve / eval)
checks it first: a truncated, missing or altered file is one line naming the file, never a
loader's traceback or a silently wrong adapter. A directory without a manifest (written by an
older lorafuse, or a plain PEFT adapter) is not checked; callers say so where it matters.

``{"format": "lorafuse-manifest", "version": 1, "files": {"<relative path>": {"size": bytes,
"sha256": hex}}}``
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from lorafuse import files
from lorafuse.errors import LorafuseError

MANIFEST_NAME = "lorafuse_manifest.json"
FORMAT = "lorafuse-manifest"
VERSION = 1
_CHUNK = 1 << 20


class ManifestError(LorafuseError, OSError):
    """A checkpoint's files do not match its manifest (torn, truncated or altered)."""


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _listing(root: Path) -> list[str]:
    """Every regular file under ``root`` but the manifest, as sorted POSIX relative paths."""
    out = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.name != MANIFEST_NAME:
            out.append(path.relative_to(root).as_posix())
    return sorted(out)


def write(directory: str | os.PathLike) -> Path:
    """Record every file of ``directory`` (its size and SHA-256) in its manifest, atomically.
    Call it when the directory is complete: what is written after it is not covered."""
    root = Path(directory)
    entries = {
        rel: {"size": (root / rel).stat().st_size, "sha256": sha256_of(root / rel)}
        for rel in _listing(root)
    }
    doc = {"format": FORMAT, "version": VERSION, "files": entries}
    return files.write_json(root / MANIFEST_NAME, doc, sort_keys=True)


def has_manifest(directory: str | os.PathLike) -> bool:
    return (Path(directory) / MANIFEST_NAME).is_file()


def _entries(root: Path) -> dict:
    try:
        doc = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{MANIFEST_NAME} is unreadable ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{MANIFEST_NAME} is not a lorafuse manifest")
    entries = doc.get("files")
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{MANIFEST_NAME} is not a lorafuse manifest")
    if doc.get("version") != VERSION:
        raise ValueError(f"{MANIFEST_NAME} has version {doc.get('version')}, expected {VERSION}")
    return entries


def problem(directory: str | os.PathLike) -> str | None:
    """What is wrong with ``directory`` against its manifest (the first problem found), or None
    when every listed file is there with its recorded size and SHA-256. Sizes are checked for all
    files before any is hashed: a truncation is found without reading the rest."""
    root = Path(directory)
    try:
        entries = _entries(root)
    except ValueError as err:
        return str(err)
    for rel, want in sorted(entries.items()):
        path = root / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want.get("size"):
            return f"{rel} is {size} bytes, its manifest says {want.get('size')} (truncated?)"
    for rel, want in sorted(entries.items()):
        if sha256_of(root / rel) != want.get("sha256"):
            return f"{rel} does not match its manifest's SHA-256 (altered or corrupted)"
    return None


def verify(directory: str | os.PathLike, what: str | None = None) -> bool:
    """Raise :class:`ManifestError` (one line, ``what`` naming the directory as the user gave it)
    if ``directory`` does not match its manifest; True if it has one and matches, False if it
    has none (not checked)."""
    if not has_manifest(directory):
        return False
    found = problem(directory)
    if found is not None:
        raise ManifestError(f"{what or directory}: damaged checkpoint: {found}")
    return True
