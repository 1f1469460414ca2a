"""The run directory (``output_dir``): one writer at a time, and never a new run on top of an old.

:func:`claim` is what every run does before it writes anything (``lorafuse train`` of every
method and its ``--nproc`` launcher, ``lorafuse train-image``, the web UI's runs, Python's
``train(config)`` / ``train_image(config)``), and undoes when the run ends however it ends
(finished, Ctrl-C, a non-finite loss, an error):

1. **Lock.** ``<output_dir>/run.lock`` is ``flock``-ed for the whole run and holds who took it
   (``{"pid", "host", "started", "command"}``, JSON). A second writer is refused with one line
   naming the holder. The kernel drops a flock when its process dies, however it dies; the record
   a killed run leaves behind is a stale lock, taken over with a warning. The file is removed at
   release. Where the file system cannot flock, the record alone decides (a live process it
   names on this host keeps the directory), with a warning.
2. **Refuse.** A directory that holds a run (``status.json``, ``checkpoint-*``, ``final/``,
   ``logging.jsonl``) is
   refused unless the run resumes (``--resume``) or starts over (``--overwrite``).
3. **Overwrite moves, never deletes.** The old run's files (:data:`RUN_FILES`, ``checkpoint-*``,
   leftover ``.tmp-*``) move to a new sibling ``<output_dir>.old-<YYYYmmdd-HHMMSS>/``; other files
   in the directory (a config, the data) stay where they are.

Ranks of one job share the lock: the ``--nproc`` launcher claims the directory and names itself
to its workers in ``LORAFUSE_RUN_LOCK_PID``; rank 0 finds the lock held by that pid and runs
under it. Under a plain ``torchrun`` rank 0 claims it; other ranks never do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lorafuse.errors import LorafuseError
from lorafuse.train import status as run_status

LOCK_NAME = "run.lock"
LAUNCHER_ENV = "LORAFUSE_RUN_LOCK_PID"  # the --nproc launcher that holds the lock for its ranks
# with checkpoint-<step>: what makes a directory hold a run (a new run would mix its files in)
MARKERS = ("status.json", "final", "logging.jsonl")
RUN_FILES = (*MARKERS, "initial_adapter", "tensorboard", "samples")
_CHECKPOINT = re.compile(r"^checkpoint-\d+$")


class RunDirError(LorafuseError, RuntimeError):
    """The output directory holds another run, or another process is writing to it."""


def _say(msg: str) -> None:
    print(f"lorafuse: {msg}", file=sys.stderr, flush=True)


# ---- what a directory holds ---------------------------------------------------------------------
def run_markers(directory: str | os.PathLike) -> list[str]:
    """The entries of ``directory`` that show it holds a run (empty: it holds none). A run that
    failed before its first step leaves only its ``status.json``: nothing to keep, not counted."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [n for n in names if n in MARKERS or _CHECKPOINT.match(n)]
    if found == ["status.json"]:
        state = run_status.read(directory)
        if state is not None and state["state"] == "failed" and not state.get("step"):
            return []
    return sorted(found, key=lambda n: (not n.startswith("checkpoint"), _step_order(n)))


def _step_order(name: str) -> tuple[int, str]:
    return (int(name.split("-")[1]), name) if _CHECKPOINT.match(name) else (0, name)


def _run_files(directory: str) -> list[str]:
    """Every entry of ``directory`` a run wrote (what ``--overwrite`` moves aside)."""
    return sorted(n for n in os.listdir(directory)
                  if n in RUN_FILES or _CHECKPOINT.match(n) or n.startswith(".tmp-"))  # fmt: skip


def describe(directory: str | os.PathLike) -> str:
    """``a finished run (step 7 of 7; checkpoint-4, checkpoint-6, final/, status.json)``."""
    names = run_markers(directory)
    ckpts = [n for n in names if n.startswith("checkpoint")]
    if len(ckpts) > 3:  # name the first and the last
        names = [ckpts[0], f"... {ckpts[-1]} ({len(ckpts)} checkpoints)",
                 *[n for n in names if not n.startswith("checkpoint")]]  # fmt: skip
    listed = ", ".join(n + "/" if n == "final" else n for n in names)
    state = run_status.read(directory)
    if state is None:
        return f"a run ({listed})"
    total = f" of {state['total_steps']}" if state.get("total_steps") else ""
    article = "an" if state["state"][0] in "aeiou" else "a"  # an interrupted run
    return f"{article} {state['state']} run (step {state.get('step')}{total}; {listed})"


def refuse_existing(directory: str | os.PathLike) -> None:
    """Raise :class:`RunDirError` if ``directory`` holds a run: what is there and the two ways on."""
    if not run_markers(directory):
        return
    raise RunDirError(
        f"{directory} already holds {describe(directory)}; continue it with --resume {directory}, "
        f"or start a new run there with --overwrite (moves the old run's files to "
        f"{aside_name(directory, '<time>')}, deletes nothing)"
    )


def aside_name(directory: str | os.PathLike, stamp: str) -> str:
    return f"{str(directory).rstrip('/') or '/'}.old-{stamp}"


def move_aside(directory: str | os.PathLike) -> str:
    """Move the run in ``directory`` to a new ``<directory>.old-<time>/``; return its path."""
    directory = os.path.abspath(directory)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = aside_name(directory, stamp), 1
    while os.path.lexists(aside):
        n += 1
        aside = aside_name(directory, f"{stamp}-{n}")
    os.makedirs(aside)
    for name in _run_files(directory):
        shutil.move(os.path.join(directory, name), os.path.join(aside, name))  # a rename here
    return aside


# ---- the lock -----------------------------------------------------------------------------------
def _process_started(pid: int) -> float | None:
    """``pid``'s start time (seconds since the epoch), None where no such process runs."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


def alive(record: dict) -> bool:
    """Whether the process a lock record names still runs (on this host; elsewhere: unknown,
    taken as alive). A recycled pid has another start time."""
    if record.get("host") != socket.gethostname():
        return True
    started = _process_started(int(record.get("pid") or 0))
    return started is not None and abs(started - float(record.get("pid_started") or 0)) < 1.0


def holder_text(record: dict | None, path: str | os.PathLike) -> str:
    if not record:
        return f"a process that has not recorded itself yet (lock file {path})"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("started", 0))))
    return (f"pid {record.get('pid')} on {record.get('host')}, started {when} "
            f"({record.get('command', '?')}; lock file {path})")  # fmt: skip


def read_record(path: str | os.PathLike) -> dict | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "pid" in data else None


def holder(directory: str | os.PathLike) -> dict | None:
    """The live process that holds ``directory``'s lock by its record, or None. A read only
    (no flock): for views such as the web UI's, not for deciding who may write."""
    record = read_record(Path(directory) / LOCK_NAME)
    return record if record and alive(record) else None


class RunLocked(RunDirError):
    def __init__(self, message: str, record: dict | None) -> None:
        super().__init__(message)
        self.record = record


class RunLock:
    """``<directory>/run.lock``: an exclusive flock plus the holder's record, until released."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = str(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self.fd: int | None = None

    def acquire(self, say: Callable[[str], None] = _say) -> None:
        """Take the lock or raise :class:`RunLocked` naming its holder; a stale record (its
        process is gone) is taken over with a warning through ``say``."""
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._refuse(read_record(self.path))
            except OSError as err:  # a file system without locks (some network mounts)
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                say(f"warning: {self.directory} cannot be flock-ed ({err.strerror}): the lock "
                    "is its record only (a live process named in it on this host keeps it)")  # fmt: skip
            # the holder may have released (unlinked) the file between our open and flock
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise RunDirError(f"{self.path}: could not take the lock (it keeps being replaced)")
        old = read_record(self.path)
        if old is not None:
            if old.get("host") == socket.gethostname() and alive(old):  # flock not honoured here
                os.close(fd)
                self._refuse(old)
            gone = "is gone" if old.get("host") == socket.gethostname() else "holds it no more"
            say(f"warning: taking over a stale lock: {holder_text(old, self.path)} {gone}")
        self.fd = fd
        self._write_record()

    def _refuse(self, record: dict | None) -> None:
        raise RunLocked(
            f"{self.directory} is in use by another run: {holder_text(record, self.path)}; wait "
            "for it to end or stop it, or use another --output-dir",
            record,
        )

    def _write_record(self) -> None:
        pid = os.getpid()
        record = {"pid": pid, "host": socket.gethostname(), "started": time.time(),
                  "pid_started": _process_started(pid),
                  "command": " ".join(os.path.basename(a) if i == 0 else a
                                      for i, a in enumerate(sys.argv))[:300]}  # fmt: skip
        data = (json.dumps(record, sort_keys=True) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Remove the lock file and drop the flock (in that order: a newcomer that opened the
        old file sees it replaced and tries again). Safe to call twice."""
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


# ---- a run's claim ------------------------------------------------------------------------------
@contextlib.contextmanager
def claim(output_dir: str | os.PathLike, *, resume: str | None = None, overwrite: bool = False,
          enabled: bool = True, say: Callable[[str], None] = _say) -> Iterator[None]:  # fmt: skip
    """Hold ``output_dir`` for the block: lock it, refuse a run already there unless ``resume``,
    move it aside with ``overwrite`` (module docstring). ``enabled=False``: a rank other than 0,
    which leaves the directory to rank 0."""
    if not enabled:
        yield
        return
    if overwrite and resume:
        raise RunDirError("--overwrite starts a new run and --resume continues one: not both")
    directory = str(output_dir)
    lock = RunLock(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        lock.acquire(say)
    except OSError as err:  # not writable, not a directory...
        raise RunDirError(f"cannot use {directory} as the output directory: {err}") from None
    except RunLocked as err:
        launcher = os.environ.get(LAUNCHER_ENV)
        if not (launcher and err.record and str(err.record.get("pid")) == launcher):
            raise
        yield  # a rank of a --nproc job: its launcher holds the lock and prepared the directory
        return
    try:
        if resume is None:
            if overwrite and run_markers(directory):
                what = describe(directory)
                say(f"--overwrite: moved {what} to {move_aside(directory)}")
            refuse_existing(directory)
        yield
    finally:
        lock.release()
