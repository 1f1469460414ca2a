"""The UI's child processes (training runs, jobs, chat workers) and the files they leave: the
environment they start with, whether one is still the process we started, its exit status, and
reading what it wrote (metrics lines, log tails, the last error line, its YAML config) without
ever blocking on or tripping over a file that is still being written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil

import lorafuse
from lorafuse import files


def write_json(path: Path, data: dict) -> None:
    """Atomic JSON write: a reader sees the old file or the new one, never half of one."""
    files.write_json(path, data, sort_keys=True)


def child_env() -> dict[str, str]:
    """The environment of child processes: ours, unbuffered, importing this same lorafuse."""
    env = dict(os.environ)
    src = str(Path(lorafuse.__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([src, *[p for p in paths if p != src]])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def process_alive(pid: int | None, started: float | None) -> bool:
    """Is ``pid`` the same process we started (start time matches) and not a zombie?"""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if started is not None and abs(p.create_time() - started) > 1.0:
            return False  # the pid was recycled by an unrelated process
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap(pid: int) -> int | None:
    """Exit status of ``pid`` if it is an exited child of this process (else None)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done == pid else None


class MetricsLog:
    """Incremental reader of a run's ``logging.jsonl``: only complete lines, each read once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.records: list[dict] = []

    def refresh(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.records
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        for line in data[:end].splitlines():
            if line.strip():
                try:
                    self.records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn line from a killed writer: skip it, keep the rest
        self.offset += end
        return self.records


def read_tail(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read()
    except FileNotFoundError:
        return b""


def last_error_line(tail: bytes) -> str | None:
    """The last line that reads like an error (``lorafuse train: error: ...``, an exception)."""
    lines = [
        ln.strip() for ln in tail.decode("utf-8", errors="replace").replace("\r", "\n").split("\n")
    ]
    for line in reversed(lines):
        if "error" in line.lower() or line.startswith(("Traceback", "Killed")):
            return line[:500]
    return None


def read_yaml(path: Path) -> dict:
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}
