"""Export jobs: ``lorafuse merge`` / ``lorafuse export --format gguf`` of a run, in the background.

``<workspace>/exports/<job id>/`` holds ``job.json`` (atomic), ``output.log`` (the command's
stdout + stderr, a file) and the result: ``merged/`` (a Hugging Face model dir) or ``model.gguf``.
The job exports the run's ``final/`` adapter, or its latest checkpoint when it has no final one.
Jobs run beside training (they do not count against the one-training-run rule) and, like runs,
are detached, found again on restart and settled from their files if they ended unwatched.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import psutil

from lorafuse import files
from lorafuse.train.checkpoint import list_checkpoints
from lorafuse.ui.errors import BadRequest, Conflict, NotFound
from lorafuse.ui.processes import (
    child_env,
    last_error_line,
    process_alive,
    read_tail,
    reap,
    write_json,
)

KINDS = ("merge", "gguf")
# The GGUF types the export form offers (every one `lorafuse export --outtype` takes is accepted)
GGUF_OUTTYPES = ("f16", "bf16", "f32", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")


class JobManager:
    def __init__(self, workspace: str | Path, runs) -> None:
        self.workspace = Path(workspace).resolve()
        self.dir = self.workspace / "exports"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.runs = runs
        self.lock = threading.RLock()
        self.jobs: dict[str, dict] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        for path in sorted(self.dir.glob("*/job.json")):
            try:
                job = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            self.jobs[job["id"]] = job
        self.tick()

    def create(
        self, run_id: str, kind: str, outtype: str | None = None, pre_tokenizer: str | None = None
    ) -> dict:
        """Start a ``kind`` export of the run's adapter; ``pre_tokenizer``: llama.cpp's name for a
        tokenizer it cannot identify itself (``lorafuse export --pre-tokenizer``)."""
        if kind not in KINDS:
            raise BadRequest(f"kind={kind!r}: one of {', '.join(KINDS)}")
        outtype = outtype or "f16"
        if kind == "gguf" and outtype not in GGUF_OUTTYPES:
            raise BadRequest(f"outtype={outtype!r}: one of {', '.join(GGUF_OUTTYPES)}")
        if pre_tokenizer is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", pre_tokenizer):
            raise BadRequest(f"pre_tokenizer={pre_tokenizer!r}: a llama.cpp pre-tokenizer name")
        self.runs.get(run_id)  # 404 for an unknown run
        out = self.runs.run_dir(run_id) / "out"
        source = out / "final"
        if not source.is_dir():
            ckpts = list_checkpoints(str(out))
            if not ckpts:
                raise Conflict(f"run {run_id} has no adapter yet (no final/ and no checkpoint)")
            source = Path(ckpts[-1][1])
        job_id = time.strftime("%Y%m%d-%H%M%S") + f"-{kind}-{len(self.jobs) + 1}"
        jdir = self.dir / job_id
        jdir.mkdir(parents=True)
        if kind == "merge":
            output = jdir / "merged"
            argv = ["merge", "--checkpoint", str(source), "-o", str(output)]
        else:
            output = jdir / "model.gguf"
            argv = ["export", "--checkpoint", str(source), "--format", "gguf", "-o", str(output),
                    "--outtype", outtype]  # fmt: skip
            if pre_tokenizer:
                argv += ["--pre-tokenizer", pre_tokenizer]
        cmd = [sys.executable, "-m", "lorafuse", *argv]
        with open(jdir / "output.log", "ab") as log:
            log.write(f"=== lorafuse ui: {' '.join(cmd[1:])}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=jdir, env=child_env(), start_new_session=True)  # fmt: skip
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            started = None
        job = {
            "id": job_id, "kind": kind, "status": "running", "run_id": run_id,
            "source": str(source.relative_to(self.workspace)), "outtype": outtype if kind == "gguf" else None,
            "output": str(output.relative_to(self.workspace)), "pid": proc.pid, "pid_started": started,
            "created": time.time(), "ended": None, "exit_code": None, "message": None,
        }  # fmt: skip
        with self.lock:
            self.jobs[job_id] = job
            self.procs[job_id] = proc
            write_json(jdir / "job.json", job)
        return self.view(job_id)

    def get(self, job_id: str) -> dict:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no export job {job_id!r}")
        return job

    def tick(self) -> None:
        with self.lock:
            for job in self.jobs.values():
                if job["status"] != "running":
                    continue
                proc = self.procs.get(job["id"])
                code = proc.poll() if proc is not None else None
                if proc is not None and code is None:
                    continue
                if proc is None:
                    if process_alive(job["pid"], job.get("pid_started")):
                        continue
                    code = reap(job["pid"])
                self._settle(job, code)

    def _settle(self, job: dict, code: int | None) -> None:
        jdir = self.dir / job["id"]
        output = self.workspace / job["output"]
        tail = read_tail(jdir / "output.log", 8192)
        if code == 0 or (code is None and output.exists()):
            job.update(status="finished", message=None)
        else:
            err = last_error_line(tail)
            prefix = "unknown exit" if code is None else f"exit status {code}"
            job.update(status="failed", message=f"{prefix}: {err}" if err else prefix)
        job.update(exit_code=code, ended=time.time(), pid=None)
        self.procs.pop(job["id"], None)
        write_json(jdir / "job.json", job)

    def view(self, job_id: str) -> dict:
        job = dict(self.get(job_id))
        tail = read_tail(self.dir / job_id / "output.log", 4096).decode("utf-8", "replace")
        job["log_tail"] = "\n".join(ln.split("\r")[-1] for ln in tail.split("\n")[-30:])
        job.pop("pid_started", None)
        return job

    def list(self) -> list[dict]:
        with self.lock:
            ids = sorted(self.jobs, key=lambda i: self.jobs[i]["created"], reverse=True)
            return [self.view(i) for i in ids]

    def download_path(self, job_id: str) -> Path:
        """The file to send: the GGUF itself, or a zip of the merged dir (made once, atomically)."""
        job = self.get(job_id)
        if job["status"] != "finished":
            raise Conflict(f"export job {job_id} is {job['status']}")
        output = self.workspace / job["output"]
        if output.is_file():
            return output
        archive = output.with_suffix(".zip")
        if not archive.is_file():
            with files.atomic_path(archive) as tmp:
                with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
                    for f in sorted(output.rglob("*")):
                        if f.is_file():
                            zf.write(f, Path(output.name) / f.relative_to(output))
        return archive

    def close(self) -> None:
        """Nothing to stop: export processes finish on their own and are found again later."""
