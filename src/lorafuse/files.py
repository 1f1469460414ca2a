"""Atomic file writes: a reader (or a process killed mid-write) sees the old file or the new one,
never half of one. Every file lorafuse writes for a user goes through here.

The temporary file sits in the target's directory (a rename is atomic only within one file
system), is named after the target, the process and the thread (concurrent writers never share
one) and keeps the target's suffix (writers such as PIL pick the format from it).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lorafuse.errors import LorafuseError

_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")


class DiskFullError(LorafuseError, OSError):
    """The disk filled while lorafuse wrote something; the message says where and what to do."""


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


def is_disk_full(err: BaseException) -> bool:
    """ENOSPC / EDQUOT, also when a library wraps it in its own error and keeps only the text
    (safetensors' ``SafetensorError: ... No space left on device (os error 28)``)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(text in str(err) for text in _FULL_TEXTS)


def tree_size(path: str | os.PathLike) -> int:
    """Bytes in the files under ``path`` (0 if it is gone)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def free_bytes(path: str | os.PathLike) -> int:
    """Free space of the file system holding ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def mb(n: int) -> str:
    """A size for a message: MB, or kB below one MB."""
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


@contextmanager
def disk_full_as_error(what: str, where: str | os.PathLike, needed: int | None = None,
                       then: str | Callable[[], str] = "") -> Iterator[None]:  # fmt: skip
    """Turn a disk-full failure inside the block into one :class:`DiskFullError` line naming
    ``what`` was being written ``where``, the bytes ``needed`` when known, the free space and
    ``then`` (what was cleaned up, what to do next). The writer removes its partial files
    itself, inside the block (atomic_path does)."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if not is_disk_full(err):
            raise
        need = f"needs about {mb(needed)}, " if needed else ""
        then = then() if callable(then) else then  # a callable: what holds at the failure
        raise DiskFullError(
            f"disk full writing {what} to {where}: {need}{mb(free_bytes(where))} free"
            f"{'; ' + then if then else ''}"
        ) from err
