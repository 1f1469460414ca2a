"""Atomic file writes: a reader (or a process killed mid-write) sees the old file or the new one,
never half of one. Every file lorafuse writes for a user goes through here.

The temporary file sits in the target's directory (a rename is atomic only within one file
system), is named after the target, the process and the thread (concurrent writers never share
one) and keeps the target's suffix (writers such as PIL pick the format from it).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_path_for(path: str | os.PathLike) -> Path:
    """Where :func:`atomic_path` stages ``path``: ``.<name>.tmp-<pid>-<thread><suffix>`` beside it."""
    path = Path(path)
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}-{threading.get_ident()}{path.suffix}")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; on a clean exit it replaces
    ``path`` in one rename, on an exception (Ctrl-C included) it is removed and ``path`` is
    untouched."""
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, data, **dump_options) -> Path:
    """``data`` as JSON (``indent=2`` unless told otherwise) with a final newline."""
    dump_options.setdefault("indent", 2)
    return write_text(path, json.dumps(data, **dump_options) + "\n")


def write_jsonl(path: str | os.PathLike, records) -> Path:
    """One JSON object per line (UTF-8 kept as is)."""
    return write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the finished directory ``tmp`` to ``final``. An existing ``final`` is moved aside
    first and deleted only once the new one is in place, so a crash leaves one of the two whole."""
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
