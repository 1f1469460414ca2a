"""``<output_dir>/status.json``: the run's state for programs (the web UI, schedulers), so none of
them has to parse the human log. Rewritten atomically on each change by rank 0; the fields:

* ``state``: ``running`` | ``finished`` | ``interrupted`` (a checkpoint was saved; resume it) |
  ``failed``;
* ``step``, ``total_steps``; ``pid``; ``updated`` (Unix time);
* ``checkpoint`` (interrupted: the directory to ``--resume``), ``adapter`` (finished: ``final/``),
  ``error`` (failed: the one-line message), ``summary`` (finished: what ``train`` returned).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from lorafuse import files

FILENAME = "status.json"
STATES = ("running", "finished", "interrupted", "failed")


def read(output_dir: str | os.PathLike) -> dict | None:
    """The status a run wrote in ``output_dir``, or None where there is none (yet) or it is torn."""
    import json

    try:
        data = json.loads((Path(output_dir) / FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("state") in STATES else None


class RunStatus:
    """Writes ``status.json`` for one run (a no-op on ranks other than 0)."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.path = Path(output_dir) / FILENAME
        self.enabled = enabled
        self.fields: dict = {"state": "running", "step": 0, "total_steps": None}

    def update(self, **fields) -> None:
        if not self.enabled:
            return
        self.fields.update(fields, pid=os.getpid(), updated=time.time())
        assert self.fields["state"] in STATES, self.fields["state"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        files.write_json(self.path, self.fields, sort_keys=True, default=str)
