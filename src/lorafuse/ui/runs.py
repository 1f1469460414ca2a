"""Training runs as detached processes whose whole state lives on disk, plus the one-at-a-time queue.

Layout: ``<workspace>/runs/<id>/`` holds

* ``run.json``: the run's record (status, pid and its start time, exit code, queue time...),
  rewritten atomically (temp file + rename) on every change;
* ``train.yaml``: the generated :class:`TrainConfig` (``output_dir`` = ``<run dir>/out``);
* ``output.log``: stdout + stderr of every process of the run (train, then each resume), a FILE
  and never a pipe, so a run can never block on a reader that went away;
* ``out/``: what the trainer writes: ``logging.jsonl``, ``checkpoint-<step>/``, ``final/``.

A run is ``python -m lorafuse train --config train.yaml`` (resume: ``--resume <run dir>/out``, which
reads the config stored in the checkpoint and appends to the same ``logging.jsonl``), started with
``start_new_session=True`` so it has its own process group and outlives the UI server. Stop sends
SIGTERM to that group: the trainer saves a checkpoint after the current step and exits with 130;
SIGKILL follows only after ``stop_timeout`` seconds.

On startup :class:`RunManager` scans the workspace: a run recorded as running whose pid is alive
(same pid *and* process start time, so a recycled pid is not mistaken for it) is adopted; one whose
process vanished while no UI watched it gets its status from the trainer's own ``out/status.json``
(:mod:`lorafuse.train.status`: finished, interrupted at step N, failed with its error), or
"failed: unknown exit".
A watcher thread polls the active run, writes its exit status, enforces the stop timeout, and
starts the oldest queued run when none is active.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from lorafuse import files
from lorafuse.errors import LorafuseError
from lorafuse.train import run_dir as train_dir
from lorafuse.train import status as run_status
from lorafuse.train.checkpoint import list_checkpoints
from lorafuse.train.config import TrainConfig
from lorafuse.ui.errors import Conflict, NotFound
from lorafuse.ui.form import to_yaml
from lorafuse.ui.processes import (
    MetricsLog,
    child_env,
    last_error_line,
    process_alive,
    read_tail,
    read_yaml,
    reap,
    write_json,
)

STATUSES = ("queued", "running", "stopping", "stopped", "finished", "failed", "cancelled")
ACTIVE = ("running", "stopping")
# the trainers' EVAL_KEY: Trainer evaluates a loss, GRPOTrainer a reward
EVAL_KEYS = ("eval_loss", "eval_reward")
INTERRUPTED_EXIT = 130  # `lorafuse train` after SIGTERM / Ctrl-C with a checkpoint saved


class RunManager:
    """All runs of one workspace; thread-safe; :meth:`start` the watcher, :meth:`close` at exit."""

    def __init__(self, workspace: str | os.PathLike, *, stop_timeout: float = 60.0,
                 poll_interval: float = 0.5) -> None:  # fmt: skip
        self.workspace = Path(workspace).resolve()
        self.runs_dir = self.workspace / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.stop_timeout = stop_timeout
        self.poll_interval = poll_interval
        self.lock = threading.RLock()
        self.runs: dict[str, dict] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.metrics: dict[str, MetricsLog] = {}
        self.version = 0  # bumped on every status change (event streams watch it)
        self.on_tick = []  # extra callables run by the watcher (export jobs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_file = None
        self._take_workspace()  # before the scan: never settle another live server's runs
        self.scan()

    # ---- persistence -------------------------------------------------------------------------
    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    def scan(self) -> None:
        """Load every ``runs/*/run.json``; settle runs whose process ended while nobody watched."""
        with self.lock:
            for path in sorted(self.runs_dir.glob("*/run.json")):
                try:
                    run = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError):
                    continue  # not a run we can read; leave it alone
                self.runs[run["id"]] = run
                self.metrics[run["id"]] = MetricsLog(path.parent / "out" / "logging.jsonl")
                if run["status"] in ACTIVE and not process_alive(
                    run.get("pid"), run.get("pid_started")
                ):
                    self._settle(run, reap(run["pid"]) if run.get("pid") else None)

    def _save(self, run: dict) -> None:
        write_json(self.run_dir(run["id"]) / "run.json", run)
        self.version += 1

    # ---- the public operations ---------------------------------------------------------------
    def create(self, cfg: TrainConfig, name: str | None = None) -> dict:
        """A new run for ``cfg`` (its output_dir is replaced by the run's own); queued or started."""
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        rdir = self.run_dir(run_id)
        rdir.mkdir(parents=True)
        cfg.output_dir = str(rdir / "out")
        cfg.resume, cfg.overwrite = None, False  # a new run dir: never on top of another run
        files.write_text(rdir / "train.yaml", to_yaml(cfg))
        now = time.time()
        model = os.path.basename(cfg.model.rstrip("/")) if cfg.model else "SmolLM2-135M"
        run = {
            "id": run_id, "name": name or f"{model} r{cfg.lora_r}", "status": "queued",
            "created": now, "queued_at": now, "started": None, "ended": None, "pid": None,
            "pid_started": None, "exit_code": None, "message": None, "action": "train",
            "stop_requested_at": None, "total_steps": cfg.max_steps, "launches": 0,
        }  # fmt: skip
        with self.lock:
            self.runs[run_id] = run
            self.metrics[run_id] = MetricsLog(rdir / "out" / "logging.jsonl")
            self._save(run)
            self._start_next()
            return self.view(run_id)

    def get(self, run_id: str) -> dict:
        run = self.runs.get(run_id)
        if run is None:
            raise NotFound(f"no run {run_id!r}")
        return run

    def stop(self, run_id: str) -> dict:
        with self.lock:
            run = self.get(run_id)
            if run["status"] == "queued":
                raise Conflict(f"run {run_id} is queued, not running: cancel it instead")
            if run["status"] not in ACTIVE:
                raise Conflict(f"run {run_id} is {run['status']}, not running")
            if run["status"] == "running":
                self._signal(run, signal.SIGTERM)
                run["status"] = "stopping"
                run["stop_requested_at"] = time.time()
                self._save(run)
            return self.view(run_id)

    def resume(self, run_id: str) -> dict:
        with self.lock:
            run = self.get(run_id)
            if run["status"] in (*ACTIVE, "queued", "finished"):
                raise Conflict(f"run {run_id} is {run['status']}: nothing to resume")
            out = self.run_dir(run_id) / "out"
            if not list_checkpoints(str(out)):
                raise Conflict(f"run {run_id} has no checkpoint to resume from")
            holder = train_dir.holder(out)
            if holder is not None:  # e.g. a `lorafuse train --resume` started outside the UI
                raise Conflict(f"run {run_id}: {out} is in use by another process: "
                               f"{train_dir.holder_text(holder, out / train_dir.LOCK_NAME)}")  # fmt: skip
            run.update(status="queued", queued_at=time.time(), action="resume", ended=None,
                       exit_code=None, message=None, stop_requested_at=None)  # fmt: skip
            self._save(run)
            self._start_next()
            return self.view(run_id)

    def cancel(self, run_id: str) -> dict:
        with self.lock:
            run = self.get(run_id)
            if run["status"] != "queued":
                raise Conflict(
                    f"run {run_id} is {run['status']}: only a queued run can be cancelled"
                )
            run.update(status="cancelled", ended=time.time(), queued_at=None)
            self._save(run)
            return self.view(run_id)

    # ---- processes ---------------------------------------------------------------------------
    def _start_next(self) -> None:
        """Launch the oldest queued run if nothing is training (one run at a time)."""
        if any(r["status"] in ACTIVE for r in self.runs.values()):
            return
        queued = [r for r in self.runs.values() if r["status"] == "queued"]
        if queued:
            run = min(queued, key=lambda r: r["queued_at"])
            try:
                self._launch(run)
            except (OSError, LorafuseError) as err:  # cannot start it: say so on the run
                run.update(status="failed", message=f"could not start: {err}", ended=time.time(),
                           queued_at=None)  # fmt: skip
                self._save(run)

    def _launch(self, run: dict) -> None:
        rdir = self.run_dir(run["id"])
        if run["action"] == "resume":
            argv = ["train", "--resume", str(rdir / "out")]
        else:  # the trainer refuses it too; here the run says why without starting a process
            train_dir.refuse_existing(rdir / "out")
            argv = ["train", "--config", str(rdir / "train.yaml")]
        cmd = [sys.executable, "-m", "lorafuse", *argv]
        with open(rdir / "output.log", "ab") as log:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"=== lorafuse ui {stamp}: {' '.join(cmd[1:])}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=rdir, env=child_env(), start_new_session=True)  # fmt: skip
        self.procs[run["id"]] = proc
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            started = None
        run.update(status="running", pid=proc.pid, pid_started=started, started=time.time(),
                   queued_at=None, launches=run.get("launches", 0) + 1)  # fmt: skip
        self._save(run)

    def _signal(self, run: dict, sig: int) -> None:
        if not process_alive(run.get("pid"), run.get("pid_started")):
            return
        try:
            os.killpg(
                run["pid"], sig
            )  # the run's own group (start_new_session): torchrun workers too
        except ProcessLookupError:
            pass

    def _settle(self, run: dict, code: int | None) -> None:
        """Write the final status of a run whose process ended (``code``: None if unknown)."""
        log_tail = read_tail(self.run_dir(run["id"]) / "output.log", 16384)
        stopped = run.get("stop_requested_at") is not None
        out = self.run_dir(run["id"]) / "out"
        trainer = run_status.read(out) or {}  # what the trainer itself recorded (train/status.py)
        interrupted = trainer.get("step") if trainer.get("state") == "interrupted" else None
        if code == 0:
            status, message = "finished", None
        elif code == INTERRUPTED_EXIT or (code is not None and stopped):
            status = "stopped"
            message = (f"interrupted at step {interrupted}; checkpoint saved"
                       if interrupted is not None else f"stopped (exit status {code})")  # fmt: skip
            if code == -signal.SIGKILL:
                message = f"killed (SIGKILL) after the {self.stop_timeout:.0f} s stop timeout"
            elif code is not None and code < 0:
                message = f"ended by signal {-code} before it could save a checkpoint"
        elif code is not None:
            status = "failed"
            message = trainer.get("error") or last_error_line(log_tail) or f"exit status {code}"
        elif trainer.get("state") == "finished" and (out / "final").is_dir():
            status, message = "finished", "exit status unknown (ended while the UI was not running)"
        elif interrupted is not None:
            status = "stopped"
            message = f"interrupted at step {interrupted}; checkpoint saved"
        else:
            status = "failed"
            err = trainer.get("error") or last_error_line(log_tail)
            message = f"unknown exit: {err}" if err else (
                "unknown exit: the process ended while the UI was not running and left no final "
                "status in out/status.json and no error line in output.log"
            )  # fmt: skip
        run.update(status=status, exit_code=code, message=message, ended=time.time(), pid=None)
        self.procs.pop(run["id"], None)
        self._save(run)

    def tick(self) -> None:
        """One watcher pass: settle ended runs, enforce stop timeouts, start queued runs."""
        with self.lock:
            for run in list(self.runs.values()):
                if run["status"] not in ACTIVE:
                    continue
                proc = self.procs.get(run["id"])
                if proc is not None:
                    code = proc.poll()
                    if code is not None:
                        self._settle(run, code)
                        continue
                elif not process_alive(run.get("pid"), run.get("pid_started")):
                    self._settle(run, reap(run["pid"]) if run.get("pid") else None)
                    continue
                asked = run.get("stop_requested_at")
                if (
                    run["status"] == "stopping"
                    and asked
                    and time.time() - asked > self.stop_timeout
                ):
                    self._signal(run, signal.SIGKILL)
            self._start_next()
        for fn in self.on_tick:
            fn()

    def _take_workspace(self) -> None:
        """One UI server per workspace: an exclusive lock held until :meth:`close`."""
        import fcntl

        f = open(self.workspace / ".lorafuse-ui.lock", "a+")  # noqa: SIM115 - held until close
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise Conflict(
                f"workspace {self.workspace} is already served by another lorafuse ui"
            ) from None
        self._lock_file = f

    def start(self) -> None:
        """Start the watcher thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="lorafuse-ui-runs", daemon=True
            )
            self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.tick()
            except Exception as err:  # keep watching: one bad run must not stop the others
                print(f"lorafuse ui: watcher: {err!r}", file=sys.stderr)

    def close(self) -> None:
        """Stop watching. Training processes keep running: the next UI server adopts them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    # ---- views -------------------------------------------------------------------------------
    def records(self, run_id: str) -> list[dict]:
        self.get(run_id)
        with self.lock:
            return list(self.metrics[run_id].refresh())

    def view(self, run_id: str, with_config: bool = False) -> dict:
        """The Run object of the API (see ``lorafuse.ui.app``)."""
        with self.lock:
            run = self.get(run_id)
            rdir = self.run_dir(run_id)
            records = self.metrics[run_id].refresh()
            losses = [r for r in records if "loss" in r]
            last = dict(losses[-1]) if losses else {}
            for key in EVAL_KEYS:  # SFT/DPO/ORPO/KTO runs evaluate a loss, GRPO runs a reward
                evals = [r for r in records if key in r]
                if evals:
                    last[key] = evals[-1][key]
            ckpts = list_checkpoints(str(rdir / "out"))
            total = run.get("total_steps") or self._total_from_status(run)
            queued = sorted(
                (r for r in self.runs.values() if r["status"] == "queued"),
                key=lambda r: r["queued_at"],
            )
            out = {
                k: run.get(k)
                for k in ("id", "name", "status", "created", "started", "ended", "pid", "exit_code",
                          "message", "action")
            }  # fmt: skip
            out.update(
                step=max((r["step"] for r in records if "step" in r), default=0),
                total_steps=total,
                last_checkpoint_step=ckpts[-1][0] if ckpts else None,
                resumable=bool(ckpts) and run["status"] in ("stopped", "failed"),
                queue_position=next(
                    (i + 1 for i, r in enumerate(queued) if r["id"] == run_id), None
                ),
                output_dir=f"runs/{run_id}/out",
                last_metrics=last,
                has_final=(rdir / "out" / "final").is_dir(),
            )
            if with_config:
                out["config"] = read_yaml(rdir / "train.yaml")
            return out

    def _total_from_status(self, run: dict) -> int | None:
        trainer = run_status.read(self.run_dir(run["id"]) / "out") or {}
        if trainer.get("total_steps"):
            run["total_steps"] = int(trainer["total_steps"])
            return run["total_steps"]
        return None

    def list(self) -> list[dict]:
        with self.lock:
            ids = sorted(self.runs, key=lambda i: self.runs[i]["created"], reverse=True)
            return [self.view(i) for i in ids]

    def log_tail(self, run_id: str, lines: int = 200) -> str:
        """The last ``lines`` lines of ``output.log``, progress-bar redraws (``\\r``) collapsed."""
        self.get(run_id)
        raw = read_tail(self.run_dir(run_id) / "output.log", max(4096, lines * 400))
        text = raw.decode("utf-8", errors="replace")
        out = [seg.rsplit("\r", 1)[-1] if seg.strip("\r") else "" for seg in text.split("\n")]
        out = [line.split("\r")[-1] for line in out]
        return "\n".join(out[-lines:])

    def busy(self) -> bool:
        with self.lock:
            return any(r["status"] in ACTIVE for r in self.runs.values())
