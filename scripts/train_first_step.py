"""``lorafuse train`` as a new user runs it, timed to its first training step from outside.

Starts COMMAND (the rest of the line, e.g. ``venv/bin/lorafuse train --output-dir OUT ...``),
waits for the first record in ``OUT/logging.jsonl`` (the trainer appends one per logged step, so
with ``--logging-steps 1`` it appears when step 1 has finished) and reads, at that moment, the
wall seconds since launch and the process's CPU seconds from ``/proc/<pid>/stat`` (its own and its
waited-for children's: a JIT build's compilers count). Writes ``OUT/first_step.json``
(``seconds_to_first_step``, ``cpu_seconds_to_first_step``, ``seconds_total``, ``returncode``) and
exits with the command's status. Timing from outside keeps the command the user's own.

Usage: python scripts/train_first_step.py OUT -- COMMAND...   (scripts/wheel_check.sh runs it)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.05  # the first step takes seconds (wheel) to minutes (JIT build): 50 ms is noise


def cpu_seconds(pid: int) -> float | None:
    """utime + stime + cutime + cstime of ``pid`` (proc(5) fields 14-17), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    out, sep, *command = sys.argv[1:]
    if sep != "--" or not command:
        raise SystemExit(__doc__.splitlines()[-1])
    log = Path(out) / "logging.jsonl"
    start = time.monotonic()
    proc = subprocess.Popen(command)
    first = cpu = None
    while proc.poll() is None:
        if first is None and log.exists() and log.read_text().strip():
            first, cpu = time.monotonic() - start, cpu_seconds(proc.pid)
        time.sleep(POLL_S)
    total = time.monotonic() - start
    result = {"seconds_to_first_step": first, "cpu_seconds_to_first_step": cpu,
              "seconds_total": total, "returncode": proc.returncode}  # fmt: skip
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "first_step.json").write_text(json.dumps(result, indent=1))
    print(f"train_first_step: {json.dumps(result)}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
