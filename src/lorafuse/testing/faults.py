"""Injected faults for the tests of "a full disk ends in one line and leaves nothing half-written":
a real small tmpfs where this machine allows mounting one, and an ``open`` whose writes fill the
disk part-way (everywhere)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ENOSPC_TEXT = "No space left on device"


@contextlib.contextmanager
def small_tmpfs(path: str | os.PathLike, size: int):
    """A real tmpfs of ``size`` bytes mounted at ``path`` (created); the test is skipped where
    mounting is not allowed (not root, or a container without the capability)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class _HalfWritten:
    """A binary file whose first ``write`` stores half its bytes, then the disk is full."""

    def __init__(self, real_open, path, mode):
        self.f = real_open(path, mode)

    def write(self, data) -> int:
        data = bytes(data)
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, ENOSPC_TEXT)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def filling_open(real_open, fails):
    """An ``open`` to monkeypatch into a module: files for which ``fails(path, mode)`` is true
    get half of their first write, then ENOSPC; every other file opens as usual."""

    def fake_open(path, mode="r", *args, **kwargs):
        if fails(str(path), mode):
            return _HalfWritten(real_open, path, mode)
        return real_open(path, mode, *args, **kwargs)

    return fake_open


def one_error_line(capsys, command: str = "") -> str:
    """The CLI's stderr (progress lines allowed) ends in exactly one ``lorafuse <command>: error:``
    line and shows no traceback; that line. ``command`` empty: any command."""
    err = capsys.readouterr().err.strip().splitlines()
    prefix = f"lorafuse {command}: error: " if command else "lorafuse "
    errors = [x for x in err if x.startswith(prefix) and ": error: " in x]
    assert errors == err[-1:] and not any("Traceback" in x for x in err), err[-5:]
    return errors[0]
