"""The web UI's runs claim their output dir as `lorafuse train` does (lorafuse.train.run_dir): a
run whose out/ already holds a run is not started, and Resume is refused while another process (a
real one here) holds the directory's lock. No training process is started."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")

from lorafuse.ui.errors import Conflict  # noqa: E402
from lorafuse.ui.processes import write_json  # noqa: E402
from lorafuse.ui.runs import RunManager  # noqa: E402

HOLDER = """
import sys, time
from lorafuse.train import run_dir
with run_dir.claim(sys.argv[1], resume=sys.argv[1]):
    print("held", flush=True)
    time.sleep(300)
"""


def _fake_run(ws, run_id: str, status: str, action: str):
    rdir = ws / "runs" / run_id
    (rdir / "out" / "checkpoint-1").mkdir(parents=True)
    (rdir / "out" / "checkpoint-1" / "trainer_state.safetensors").write_bytes(b"")
    write_json(rdir / "out" / "status.json", {"state": "interrupted", "step": 1, "total_steps": 4})
    write_json(rdir / "run.json", {
        "id": run_id, "name": run_id, "status": status, "created": time.time(),
        "queued_at": time.time() if status == "queued" else None, "started": None, "ended": None,
        "pid": None, "pid_started": None, "exit_code": None, "message": None, "action": action,
        "stop_requested_at": None, "total_steps": 4,
    })  # fmt: skip
    return rdir / "out"


@pytest.fixture
def ws(tmp_path):  # a bare workspace: no run here gets as far as loading a model
    return tmp_path / "ws"


def test_a_queued_run_whose_out_holds_a_run_fails_without_starting(ws):
    out = _fake_run(ws, "r1", "queued", "train")
    manager = RunManager(ws)
    try:
        manager.tick()  # starts the oldest queued run: refused before any process starts
        run = manager.get("r1")
        assert run["status"] == "failed" and run["pid"] is None and not run.get("launches")
        assert run["message"].startswith(f"could not start: {out} already holds an interrupted run")
        assert "--resume" in run["message"] and "--overwrite" in run["message"]
    finally:
        manager.close()


def test_resume_is_refused_while_another_process_holds_the_dir(ws):
    out = _fake_run(ws, "r2", "stopped", "train")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE)
    manager = RunManager(ws)
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(Conflict, match=f"is in use by another process: pid {holder.pid} on "):
            manager.resume("r2")
        assert manager.get("r2")["status"] == "stopped"  # not queued
    finally:
        manager.close()
        holder.kill()
        holder.wait()
