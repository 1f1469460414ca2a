"""``lorafuse train --nproc N``: start N local ranks under torchrun and wait for them.

The workers run ``python -m lorafuse train`` with the same arguments minus ``--nproc``; signals
reach them through torchrun, and the exit status is theirs.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from lorafuse.errors import LorafuseError

log = logging.getLogger(__name__)


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


def launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Run ``lorafuse train <argv>`` on ``nproc`` local ranks under torchrun; returns its exit code.

    SIGINT / SIGTERM are forwarded to torchrun (which stops its workers); a death by signal is
    returned as 128 + signal number, like a shell.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE") or 1) > 1:
        raise LorafuseError("--nproc given inside a torchrun worker; drop --nproc under torchrun")
    cmd = torchrun_command(nproc, argv)
    log.info("launching: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if code < 0:
        code = 128 - code
    if code != 0:
        print(
            f"lorafuse train: distributed job failed (exit {code}); torchrun's report above "
            "names the rank that failed first and its error",
            file=sys.stderr,
        )
    return code
