"""A UI-launched training run whose disk fills: the run ends failed with the trainer's one-line
disk-full message as its status, and resumes from the last good checkpoint once there is room.

The fault is injected into the run's own process (a `lorafuse train` subprocess) by a
``sitecustomize`` module on its PYTHONPATH: the trainer-state file of checkpoint-2 gets half its
bytes, then ENOSPC (``lorafuse.testing.filling_open``), once; a marker file records that the
disk "filled", so the resumed process writes normally.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from test_api import wait_for  # noqa: E402  (same directory, rootdir import mode)

from lorafuse.ui.app import create_app  # noqa: E402

pytestmark = pytest.mark.slow  # two `lorafuse train` subprocesses

HOOK = """
import os
from pathlib import Path

_marker = Path(os.environ["LORAFUSE_TEST_FILL_ONCE"])
if not _marker.exists():
    from lorafuse.testing import filling_open
    from lorafuse.train import checkpoint as _ckpt

    def _fails(path, mode):
        if path.endswith(_ckpt.STATE_NAME) and "checkpoint-2" in path:
            _marker.touch()
            return True
        return False

    _ckpt.open = filling_open(open, _fails)
"""

CONFIG = {"model": "model", "data": ["data/chat.jsonl"], "max_seq_length": 64,
          "dtype": "float32", "device": "cpu", "gradient_checkpointing": False, "num_threads": 1,
          "save_steps": 1, "save_total_limit": 0, "lr": 1e-3, "max_steps": 3}  # fmt: skip


def test_disk_full_run_shows_one_line_and_resumes(ws, tmp_path, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    marker = tmp_path / "filled"
    monkeypatch.setenv("LORAFUSE_TEST_FILL_ONCE", str(marker))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    with TestClient(create_app(ws, poll_interval=0.1), base_url="http://127.0.0.1:7860") as client:
        r = client.post("/api/runs", json={"config": CONFIG, "name": "full"})
        assert r.status_code == 201, r.text
        run = wait_for(
            client, r.json()["id"], lambda r: r["status"] not in ("queued", "running"), 120
        )
        out = ws.resolve() / "runs" / run["id"] / "out"
        last = out / "checkpoint-1"
        assert marker.exists(), run  # the fault fired (else the run would have finished)
        assert run["status"] == "failed" and run["exit_code"] == 2, run
        assert run["message"].startswith(f"disk full writing checkpoint checkpoint-2 to {out}: ")
        assert f"last good checkpoint: {last} (free space, then --resume {last})" in run["message"]
        assert "\n" not in run["message"] and run["resumable"]
        assert not (out / "checkpoint-2").exists()
        assert not [n for n in os.listdir(out) if n.startswith(".tmp")]
        log = client.get(f"/api/runs/{run['id']}/log", params={"tail": 4000}).json()["text"]
        assert "Traceback" not in log and run["message"] in log

        assert client.post(f"/api/runs/{run['id']}/resume").json()["status"] in (
            "queued",
            "running",
        )
        run = wait_for(
            client, run["id"], lambda r: r["status"] in ("finished", "failed", "stopped"), 120
        )
        assert run["status"] == "finished" and run["step"] == 3, run
