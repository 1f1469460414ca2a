"""`lorafuse ui` API end to end: real `lorafuse train` subprocesses on a tiny CPU model.

One scenario test carries the expensive part (three training launches): start -> queue -> cancel
-> events with Last-Event-ID replay -> stop (SIGTERM -> checkpoint) -> the queued run starts ->
resume continues from the checkpointed step -> a new app instance finds every run. The other
tests need no training process.
"""

from __future__ import annotations

import json
import time

import pytest

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from lorafuse.ui.app import create_app  # noqa: E402

BASE = "http://127.0.0.1:7860"
TINY = {"model": "model", "data": ["data/chat.jsonl"], "max_seq_length": 64, "dtype": "float32",
        "device": "cpu", "gradient_checkpointing": False, "num_threads": 1, "save_steps": 0,
        "lr": 1e-3}  # fmt: skip


def wait_for(client, run_id, cond, timeout=90.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = client.get(f"/api/runs/{run_id}").json()
        if cond(run):
            return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} never reached the state; last: {run}")


def read_events(client, run_id, n, headers=None):
    """The first ``n`` metrics events of the run's SSE stream as (id, record)."""
    got = []
    with client.stream("GET", f"/api/runs/{run_id}/events", headers=headers or {}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        event = {}
        for line in r.iter_lines():
            if line.startswith(("id:", "event:", "data:")):
                key, _, value = line.partition(": ")
                event[key] = value
            elif not line and event:
                if event.get("event") == "metrics":
                    got.append((int(event["id"]), json.loads(event["data"])))
                    if len(got) == n:
                        break
                event = {}
    return got


def test_run_lifecycle_queue_stop_resume_restart(ws, monkeypatch):
    monkeypatch.setenv("LORAFUSE_DEBUG_STEP_SLEEP", "0.3")  # keeps run A alive long enough to stop
    app = create_app(ws, poll_interval=0.1, stop_timeout=60)
    with TestClient(app, base_url=BASE) as client:
        a = client.post("/api/runs", json={"config": {**TINY, "max_steps": 8}, "name": "A"})
        assert a.status_code == 201, a.text
        a = a.json()
        assert a["status"] == "running" and a["pid"]
        b = client.post("/api/runs", json={"config": {**TINY, "max_steps": 2}, "name": "B"}).json()
        c = client.post("/api/runs", json={"config": {**TINY, "max_steps": 2}, "name": "C"}).json()
        assert (b["status"], b["queue_position"]) == ("queued", 1)
        assert (c["status"], c["queue_position"]) == ("queued", 2)
        assert client.post(f"/api/runs/{c['id']}/cancel").json()["status"] == "cancelled"
        assert client.post(f"/api/runs/{c['id']}/cancel").status_code == 409
        assert client.get(f"/api/runs/{b['id']}").json()["queue_position"] == 1

        first = read_events(client, a["id"], 3)
        assert [step for step, _ in first] == [1, 2, 3]
        assert all("loss" in rec for _, rec in first)
        replay = read_events(client, a["id"], 1, headers={"Last-Event-ID": "2"})
        assert replay[0][0] == 3  # replay resumes right after the last event the client had

        stopping = client.post(f"/api/runs/{a['id']}/stop").json()
        assert stopping["status"] == "stopping"
        a = wait_for(client, a["id"], lambda r: r["status"] == "stopped")
        n = a["last_checkpoint_step"]
        assert n is not None and n >= 3 and a["resumable"], a
        assert a["exit_code"] == 130 and f"interrupted at step {n}" in a["message"]
        assert (
            ws / "runs" / a["id"] / "out" / f"checkpoint-{n}" / "trainer_state.safetensors"
        ).is_file()

        b = wait_for(client, b["id"], lambda r: r["status"] != "queued")  # B starts after A
        assert b["status"] == "running", b
        resumed = client.post(f"/api/runs/{a['id']}/resume").json()
        assert (resumed["status"], resumed["queue_position"]) == ("queued", 1)  # one at a time
        client.post(f"/api/runs/{b['id']}/stop")  # (B is still loading: no checkpoint, no wait)
        b = wait_for(client, b["id"], lambda r: r["status"] == "stopped")
        assert b["last_checkpoint_step"] is None and not b["resumable"]
        a = wait_for(client, a["id"], lambda r: r["status"] == "finished")
        assert a["step"] == 8 and a["last_metrics"]["loss"] > 0

        log = ws / "runs" / a["id"] / "out" / "logging.jsonl"
        steps = [json.loads(x)["step"] for x in log.read_text().splitlines() if '"loss"' in x]
        assert steps == list(range(1, 9)), steps  # resume continued at n + 1, appending
        after = client.get(f"/api/runs/{a['id']}/metrics", params={"after": 6}).json()
        assert [r["step"] for r in after["records"] if "loss" in r] == [7, 8]
        text = client.get(f"/api/runs/{a['id']}/log", params={"tail": 400}).json()["text"]
        assert f"interrupted at step {n}" in text and "resuming from" in text
        assert "\r" not in text

    with TestClient(base_url=BASE, app=create_app(ws, poll_interval=0.1)) as client:  # a UI restart
        runs = {r["name"]: r for r in client.get("/api/runs").json()["runs"]}
        assert {k: r["status"] for k, r in runs.items()} == {
            "A": "finished", "B": "stopped", "C": "cancelled"
        }  # fmt: skip
        assert runs["A"]["step"] == 8 and runs["A"]["last_checkpoint_step"] == 8
        full = client.get(f"/api/runs/{runs['A']['id']}").json()
        assert full["config"]["max_steps"] == 8
        assert full["config"]["output_dir"] == str(ws.resolve() / "runs" / full["id"] / "out")


def test_restart_settles_runs_that_ended_unwatched(ws):
    """A run recorded as running whose process is gone: status from the trainer's status.json
    (never from the wording of its log), an error line from its log, or unknown exit."""
    from lorafuse.ui.processes import write_json

    def fake(run_id, log, trainer_status=None):
        rdir = ws / "runs" / run_id
        rdir.mkdir(parents=True)
        (rdir / "output.log").write_text(log)
        if trainer_status:
            (rdir / "out").mkdir()
            write_json(rdir / "out" / "status.json", trainer_status)
        write_json(rdir / "run.json", {
            "id": run_id, "name": run_id, "status": "running", "created": time.time(),
            "queued_at": None, "started": time.time(), "ended": None, "pid": 2**22 + 7,
            "pid_started": 1.0, "exit_code": None, "message": None, "action": "train",
            "stop_requested_at": None, "total_steps": 5,
        })  # fmt: skip

    fake(
        "stopped-run",
        "reworded: stopped, see x\n",
        {"state": "interrupted", "step": 3, "total_steps": 5, "checkpoint": "x"},
    )
    fake("finished-run", "all done\n", {"state": "finished", "step": 5, "total_steps": 5})
    (ws / "runs" / "finished-run" / "out" / "final").mkdir()
    fake("log-says-interrupted", "lorafuse train: interrupted at step 3; checkpoint saved to x\n")
    fake("crashed-run", "train:  40%|####      | 2/5\r")
    fake("failed-run", "lorafuse train: error: data/x.jsonl:3: invalid JSON\n")
    with TestClient(base_url=BASE, app=create_app(ws)) as client:
        got = {r["id"]: r for r in client.get("/api/runs").json()["runs"]}
    assert got["stopped-run"]["status"] == "stopped"
    assert "interrupted at step 3" in got["stopped-run"]["message"]
    assert got["finished-run"]["status"] == "finished"
    assert got["log-says-interrupted"]["status"] == "failed"  # no status.json: the log is not read
    assert got["crashed-run"]["status"] == "failed"
    assert got["crashed-run"]["message"].startswith("unknown exit")
    assert got["failed-run"]["status"] == "failed"
    assert "invalid JSON" in got["failed-run"]["message"]
    saved = json.loads((ws / "runs" / "stopped-run" / "run.json").read_text())
    assert saved["status"] == "stopped"  # written back, not only shown


def test_one_server_per_workspace(ws):
    with TestClient(base_url=BASE, app=create_app(ws)):
        with pytest.raises(Exception, match="already served"):
            with TestClient(base_url=BASE, app=create_app(ws)):
                pass


def test_validate_returns_trainconfig_messages(ws):
    with TestClient(base_url=BASE, app=create_app(ws)) as client:
        ok = client.post("/api/config/validate", json={"config": {**TINY, "lora_r": "8"}}).json()
        assert ok["ok"] and ok["config"]["lora_r"] == 8
        assert ok["cli"].startswith("lorafuse train ") and "--lora-r 8" in ok["cli"]
        assert "lora_r: 8" in ok["yaml"]
        bad = client.post("/api/config/validate", json={"config": {**TINY, "lr": -1}}).json()
        assert not bad["ok"]
        assert bad["errors"] == [{"field": "lr", "message": "lr=-1.0: must be > 0"}]
        typed = client.post("/api/config/validate",
                            json={"config": {**TINY, "epochs": "two", "nope": 1}}).json()  # fmt: skip
        assert {e["field"] for e in typed["errors"]} == {"epochs", "nope"}
        nodata = client.post("/api/config/validate", json={"config": {"lr": 1e-4}}).json()
        assert nodata["errors"][0]["field"] == "data"
        r = client.post("/api/runs", json={"config": {**TINY, "lora_dropout": 1.5}})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "lora_dropout"
        schema = client.get("/api/config/schema").json()["fields"]
        names = {f["name"]: f for f in schema}
        assert names["lora_r"]["group"] == "lora" and names["lr"]["group"] == "optimisation"
        assert names["too_long"]["choices"] == ["truncate", "drop", "error"]
        assert "output_dir" not in names and "resume" not in names and "overwrite" not in names


def test_files_and_preview(ws):
    bad = ws / "data" / "mixed.jsonl"
    long_answer = " ".join(["the answer is one"] * 40)
    rows = [{"messages": [{"role": "user", "content": "hello"},
                          {"role": "assistant", "content": "world"}]},
            "not json",
            {"messages": [{"role": "user", "content": "what"},
                          {"role": "assistant", "content": long_answer}]},
            {"messages": [{"role": "robot", "content": "x"}]}]  # fmt: skip
    bad.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    with TestClient(base_url=BASE, app=create_app(ws)) as client:
        listing = client.get("/api/files", params={"dir": "data"}).json()
        assert {e["path"] for e in listing["entries"]} == {"data/chat.jsonl", "data/mixed.jsonl"}
        req = {"path": "data/mixed.jsonl", "model": "model", "max_seq_length": 32}
        p = client.post("/api/dataset/preview", json=req).json()
        assert p["format"] == "messages" and p["n_records"] == 4 and p["n_examples"] == 2
        assert p["truncated"] == 1 and p["dropped"] == 0
        assert [(r["file"], r["line"]) for r in p["rejected"]] == [
            ("data/mixed.jsonl", 2), ("data/mixed.jsonl", 4)
        ]  # fmt: skip
        assert "invalid JSON" in p["rejected"][0]["message"]
        assert sum(p["lengths"]["counts"]) == 2 and len(p["lengths"]["bins"]) == 21
        dropped = client.post("/api/dataset/preview", json={**req, "too_long": "drop"}).json()
        assert (dropped["truncated"], dropped["dropped"]) == (0, 1)
        err = client.post("/api/dataset/preview", json={**req, "too_long": "error"}).json()
        assert err["n_rejected"] == 3 and "max_seq_length=32" in err["rejected"][-1]["message"]


def test_estimate_shape_and_monotonic(ws):
    with TestClient(base_url=BASE, app=create_app(ws)) as client:
        small = client.post("/api/estimate", json={"config": {**TINY, "max_seq_length": 256}})
        assert small.status_code == 200, small.text
        small = small.json()
        assert set(small) >= {"peak_mem_mb", "tokens_per_s", "free_mem_mb", "basis"}
        assert small["peak_mem_mb"] > 0 and small["free_mem_mb"] > 0 and small["tokens_per_s"] > 0
        assert "measured run" in small["basis"]
        cfg = {**TINY, "max_seq_length": 256, "batch_size": 64, "data": []}  # no data needed
        big = client.post("/api/estimate", json={"config": cfg}).json()
        assert big["parts_mb"]["activations"] > small["parts_mb"]["activations"]
        assert big["peak_mem_mb"] > small["peak_mem_mb"]
        assert big["tokens_per_s"] <= small["tokens_per_s"]  # same seq: same FLOPs per token


def test_export_job_errors(ws):
    from lorafuse.ui.processes import write_json

    (ws / "runs" / "empty").mkdir(parents=True)
    write_json(ws / "runs" / "empty" / "run.json", {
        "id": "empty", "name": "empty", "status": "cancelled", "created": time.time(),
        "queued_at": None, "started": None, "ended": time.time(), "pid": None, "pid_started": None,
        "exit_code": None, "message": None, "action": "train", "stop_requested_at": None,
        "total_steps": 1,
    })  # fmt: skip
    with TestClient(base_url=BASE, app=create_app(ws)) as client:
        assert client.post("/api/runs/nope/export", json={"kind": "merge"}).status_code == 404
        r = client.post("/api/runs/empty/export", json={"kind": "merge"})
        assert r.status_code == 409 and "no adapter" in r.json()["detail"]
        bad = {"kind": "gguf", "pre_tokenizer": "x; rm -rf"}
        assert client.post("/api/runs/empty/export", json=bad).status_code == 400
        assert client.post("/api/runs/empty/resume").status_code == 409
        assert client.get("/api/jobs").json() == {"jobs": []}
        assert client.get("/api/jobs/nope").status_code == 404


def test_page_or_clean_404(ws):
    with TestClient(base_url=BASE, app=create_app(ws)) as client:
        r = client.get("/")
        assert r.status_code in (200, 404)
        if r.status_code == 404:
            assert "detail" in r.json()
        assert client.get("/static/../../etc/passwd").status_code in (400, 404)


@pytest.mark.slow  # one `lorafuse merge` subprocess
def test_merge_export_job_and_download(ws):
    """A finished run's final/ adapter merged by a background job; the dir comes back zipped."""
    import io
    import zipfile

    from lorafuse.testing import save_tiny_adapter
    from lorafuse.ui.processes import write_json

    rdir = ws / "runs" / "done"
    final = rdir / "out" / "final"
    save_tiny_adapter(ws / "model", final)
    cfg = {"model": str(ws / "model"), "max_seq_length": 64, "dtype": "float32",
           "load_in_4bit": False}  # fmt: skip
    (final / "lorafuse_config.json").write_text(json.dumps(cfg))
    write_json(rdir / "run.json", {
        "id": "done", "name": "done", "status": "finished", "created": time.time(),
        "queued_at": None, "started": time.time(), "ended": time.time(), "pid": None,
        "pid_started": None, "exit_code": 0, "message": None, "action": "train",
        "stop_requested_at": None, "total_steps": 1,
    })  # fmt: skip
    with TestClient(base_url=BASE, app=create_app(ws, poll_interval=0.1)) as client:
        assert client.post("/api/runs/done/export", json={"kind": "zip"}).status_code == 400
        job = client.post("/api/runs/done/export", json={"kind": "merge"})
        assert job.status_code == 201, job.text
        job = job.json()
        assert job["status"] == "running" and job["output"].startswith("exports/")
        deadline = time.time() + 120
        while job["status"] == "running" and time.time() < deadline:
            time.sleep(0.3)
            job = client.get(f"/api/jobs/{job['id']}").json()
        assert job["status"] == "finished", job
        assert [j["id"] for j in client.get("/api/jobs").json()["jobs"]] == [job["id"]]
        r = client.get(f"/api/jobs/{job['id']}/download")
        assert r.status_code == 200
        names = zipfile.ZipFile(io.BytesIO(r.content)).namelist()
        assert "merged/config.json" in names and any(n.endswith(".safetensors") for n in names)


def test_stop_escalates_to_sigkill_after_the_timeout(ws):
    """A run that ignores SIGTERM is killed after stop_timeout and recorded as stopped."""
    import subprocess
    import sys

    import psutil

    from lorafuse.ui.processes import write_json
    from lorafuse.ui.runs import RunManager

    mgr = RunManager(ws, stop_timeout=0.5)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout.readline() == b"up\n"  # the handler is in place
    (ws / "runs" / "stubborn").mkdir(parents=True)
    run = {"id": "stubborn", "name": "stubborn", "status": "running", "created": time.time(),
           "queued_at": None, "started": time.time(), "ended": None, "pid": proc.pid,
           "pid_started": psutil.Process(proc.pid).create_time(), "exit_code": None,
           "message": None, "action": "train", "stop_requested_at": None, "total_steps": 1}  # fmt: skip
    write_json(ws / "runs" / "stubborn" / "run.json", run)
    mgr.scan()
    mgr.procs["stubborn"] = proc
    assert mgr.stop("stubborn")["status"] == "stopping"
    time.sleep(0.3)
    mgr.tick()
    assert proc.poll() is None and mgr.view("stubborn")["status"] == "stopping"  # SIGTERM ignored
    time.sleep(0.4)
    mgr.tick()  # past the timeout: SIGKILL
    proc.wait(timeout=10)
    mgr.tick()
    view = mgr.view("stubborn")
    assert view["status"] == "stopped" and view["exit_code"] == -9
    assert "SIGKILL" in view["message"]
    mgr.close()


def test_runs_show_the_eval_key_of_their_method(ws):
    """A GRPO run evaluates a reward (GRPOTrainer.EVAL_KEY), the others a loss: the runs list shows
    each run's last eval value under its own key."""
    from lorafuse.train.engine import Trainer
    from lorafuse.train.grpo_trainer import GRPOTrainer
    from lorafuse.ui.processes import write_json
    from lorafuse.ui.runs import EVAL_KEYS

    assert set(EVAL_KEYS) == {Trainer.EVAL_KEY, GRPOTrainer.EVAL_KEY}
    for run_id, key, values in (
        ("sft", "eval_loss", (2.5, 1.5)),
        ("grpo", "eval_reward", (-0.5, 0.25)),
    ):
        out = ws / "runs" / run_id / "out"
        out.mkdir(parents=True)
        records = [
            {"step": 1, "loss": 3.0}, {"step": 1, key: values[0]},
            {"step": 2, "loss": 2.0}, {"step": 2, key: values[1]},
        ]  # fmt: skip
        (out / "logging.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        write_json(out / "status.json", {"state": "finished", "step": 2, "total_steps": 2})
        write_json(ws / "runs" / run_id / "run.json", {
            "id": run_id, "name": run_id, "status": "finished", "created": time.time(),
            "queued_at": None, "started": time.time(), "ended": time.time(), "pid": None,
            "pid_started": None, "exit_code": 0, "message": None, "action": "train",
            "stop_requested_at": None, "total_steps": 2,
        })  # fmt: skip
    with TestClient(base_url=BASE, app=create_app(ws)) as client:
        got = {r["id"]: r["last_metrics"] for r in client.get("/api/runs").json()["runs"]}
    assert got["sft"] == {"step": 2, "loss": 2.0, "eval_loss": 1.5}
    assert got["grpo"] == {"step": 2, "loss": 2.0, "eval_reward": 0.25}


def test_hugging_face_datasets_as_data(ws, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from lorafuse.testing.hf_cache import cache_hub_dataset

    qa = [{"question": f"what is {i} plus one", "answer": f"it is {i + 1}"} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(qa[:4]),
                          "test": datasets.Dataset.from_list(qa[4:])}).save_to_disk(ws / "data" / "qa")  # fmt: skip
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    cache_hub_dataset(tmp_path / "hf" / "datasets", "org/qa", {"train": qa})
    columns = ["prompt=question,completion=answer"]
    with TestClient(base_url=BASE, app=create_app(ws)) as client:
        for data, want in (("data/qa", str(ws / "data" / "qa")), ("org/qa", "org/qa")):
            cfg = {**TINY, "data": [data], "data_columns": columns, "eval_data": [data]}
            ok = client.post("/api/config/validate", json={"config": cfg}).json()
            assert ok["ok"], ok
            assert ok["config"]["data"] == [want] and ok["config"]["eval_data"] == [want]
        req = {"path": "data/qa", "model": "model", "data_columns": columns}
        p = client.post("/api/dataset/preview", json=req).json()
        assert p["path"] == "data/qa" and p["format"] == "prompt_completion"
        assert p["n_examples"] == 4 and p["first_rows"][0]["source"].endswith("qa[train]:1")
        p = client.post("/api/dataset/preview", json={**req, "data_split": "test"}).json()
        assert p["n_examples"] == 2
        p = client.post("/api/dataset/preview", json={**req, "path": "org/qa"}).json()
        assert p["path"] == "org/qa" and p["n_examples"] == 6
        missing = client.post("/api/dataset/preview", json={**req, "path": "org/none"})
        assert missing.status_code == 400 and "local Hugging Face datasets cache" in missing.text
        outside = client.post("/api/config/validate",
                              json={"config": {**TINY, "data": ["/etc/qa"]}}).json()  # fmt: skip
        assert not outside["ok"] and outside["errors"][0]["field"] == "data"
