"""``lorafuse train --nproc N``: start N local ranks under torchrun and wait for them.

The workers run ``python -m lorafuse train`` with the same arguments minus ``--nproc``; signals
reach them through torchrun, and the exit status is theirs.

torchrun starts each worker in its own session, so a worker survives torchrun's death: SIGTERM
landing while torchrun is still starting its workers (inside ``Popen``) makes it exit without
stopping the ones already started.  The launcher therefore keeps a list of every process below
torchrun (read from ``/proc`` every ``POLL_S`` and on each signal; without /proc only torchrun
itself is tracked) and kills whatever of it is left once torchrun is gone, or once torchrun has
not exited ``GRACE_S`` after a forwarded signal.  Only a worker started less than ``POLL_S``
before torchrun dies unsignalled can escape the list.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lorafuse.errors import LorafuseError

log = logging.getLogger(__name__)

# After a forwarded SIGINT / SIGTERM torchrun gives its workers 30 s (then SIGKILL) to stop, and
# the trainer uses them to save a checkpoint; 10 s more covers torchrun's own exit.  Past that it
# is stuck, and it and every process it started are killed.
GRACE_S = 40.0
POLL_S = 0.5  # how often the process tree under torchrun is re-read while waiting


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (what the torchrun workers must not see)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command :func:`launch_torchrun` runs (``argv``: the ``train`` arguments)."""
    if nproc < 1:
        raise LorafuseError(f"--nproc must be >= 1, got {nproc}")
    args = strip_nproc(argv)
    if args and args[0] == "train":  # accept the subcommand either way
        args = args[1:]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "lorafuse", "train", *args]  # fmt: skip


def start_time(pid: int) -> str | None:
    """``pid``'s start time (field 22 of /proc/<pid>/stat), None if gone: tells a recycled pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # after the command name, which may hold ")"


def descendants(pid: int) -> dict[int, str]:
    """Every live process below ``pid`` -> its start time; empty without /proc."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):  # every thread's
            try:
                kids = [int(c) for c in children.read_text().split()]
            except OSError:  # the thread or process just ended
                continue
            for kid in kids:
                started = start_time(kid)
                if started is not None and kid not in found:
                    found[kid] = started
                    todo.append(kid)
    return found


class TorchrunJob:
    """torchrun and every process seen below it; forwards signals, then enforces ``GRACE_S``."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(cmd, env=env)
        self.tree: dict[int, str] = {}
        self.signum: int | None = None
        self.deadline = float("inf")

    def record(self) -> None:
        """Add what now runs below torchrun; drop what ended (a long run starts many processes).

        Updates in place, never reassigns: :meth:`forward` may run in the middle of it."""
        for pid, started in list(self.tree.items()):
            if start_time(pid) != started:
                self.tree.pop(pid, None)
        self.tree.update(descendants(self.proc.pid))

    def forward(self, signum: int, _frame=None) -> None:
        """Signal handler: pass SIGINT / SIGTERM to torchrun, which stops its workers."""
        self.record()  # before torchrun can drop any worker
        if self.signum is None:
            self.signum, self.deadline = signum, time.monotonic() + GRACE_S
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self) -> int:
        """torchrun's exit code; kills it once ``GRACE_S`` have passed since a forwarded signal."""
        while True:
            try:
                return self.proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                self.record()
            if time.monotonic() > self.deadline:
                name = signal.Signals(self.signum).name
                print(f"lorafuse train: torchrun still running {GRACE_S:.0f} s after {name}; "
                      "killing it and its workers", file=sys.stderr)  # fmt: skip
                self.proc.kill()
                self.proc.wait()
                return -self.signum

    def kill_leftovers(self) -> None:
        """SIGKILL every recorded process still alive (and anything it started since)."""
        tree = dict(self.tree)
        for pid, started in self.tree.items():
            if start_time(pid) == started:
                tree.update(descendants(pid))
        for pid, started in tree.items():
            if start_time(pid) == started:
                log.warning("killing process %d, started under torchrun and still running", pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def launch_torchrun(nproc: int, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``lorafuse train <argv>`` on ``nproc`` local ranks under torchrun (with environment
    ``env``, default this process's); returns its exit code.

    SIGINT / SIGTERM are forwarded to torchrun (which stops its workers); a death by signal is
    returned as 128 + signal number, like a shell (the forwarded one if torchrun had to be killed).
    No process started under torchrun outlives this call.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE") or 1) > 1:
        raise LorafuseError("--nproc given inside a torchrun worker; drop --nproc under torchrun")
    cmd = torchrun_command(nproc, argv)
    log.info("launching: %s", " ".join(cmd))
    job = TorchrunJob(cmd, env)
    old = {s: signal.signal(s, job.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = job.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        job.kill_leftovers()
    if code < 0:
        code = 128 - code
    if code != 0:
        print(
            f"lorafuse train: distributed job failed (exit {code}); torchrun's report above "
            "names the rank that failed first and its error",
            file=sys.stderr,
        )
    return code
