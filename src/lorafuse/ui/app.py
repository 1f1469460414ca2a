"""The FastAPI app of ``lorafuse ui``: the HTTP API (the page's contract) and the static page.

Auth: a loopback bind without ``--token`` needs no token. Otherwise every ``/api`` call needs it as
``Authorization: Bearer <t>`` or ``?token=<t>``: missing -> 401, wrong -> 403. The Host header must
name the bound host (or a loopback name); a foreign Origin on a state-changing request -> 403.
Errors are ``{detail: "<message>"}`` with 400/401/403/404/409/422. All paths in requests and
responses are relative to the workspace.

- ``GET /api/info`` -> {version, workspace, host, cpu, free_mem_mb, total_mem_mb, device}
- ``GET /api/config/schema`` -> {fields: [{name, type, default, help, choices, group, nullable}]}
  from ``TrainConfig``; ``output_dir`` and ``resume`` are left out (the run manager sets them).
- ``POST /api/config/validate`` {config} -> {ok, errors: [{field, message}], config, cli, yaml}
- ``GET /api/files?dir=`` -> {dir, entries: [{name, path, is_dir, size}]}
- ``POST /api/dataset/preview`` {path (a file, a dataset folder or a hub id), data_format?,
  max_seq_length?, model?, too_long?, think_tokens?, data_split?, data_subset?, data_columns?} ->
  {format, n_records, first_rows, lengths: {bins, counts}, max_seq_length, truncated, dropped,
  rejected: [{file, line, message}], n_rejected, n_measured, no_targets, max_length, ...}
- ``POST /api/estimate`` {config} -> {peak_mem_mb, tokens_per_s (null when there is no measurement
  on this kind of device), free_mem_mb, fits, basis, parts_mb}
- ``GET /api/runs`` -> {runs: [Run]}; Run = {id, name, status (queued | running | stopping |
  stopped | finished | failed | cancelled), created, started, ended (unix seconds), step,
  total_steps, last_checkpoint_step, resumable, queue_position, pid, output_dir, last_metrics,
  exit_code, message (why it stopped / failed), action (train | resume), has_final}
- ``POST /api/runs`` {config, name?} -> Run (201; queued when another run is training)
- ``GET /api/runs/{id}`` -> Run + {config}
- ``POST /api/runs/{id}/stop | resume | cancel`` -> Run (409 when the run is in the wrong state)
- ``GET /api/runs/{id}/metrics?after=<step>`` -> {records: [logging.jsonl records, step > after]}
- ``GET /api/runs/{id}/events`` (SSE): ``event: metrics`` (``id: <step>``, data = one record) for
  every logging.jsonl record after ``Last-Event-ID`` (header) or ``?last_event_id=``; ``event:
  status`` (data = Run) first and on every change; ``: heartbeat`` comments every 15 s. The stream
  ends after the final status event of a run that is no longer queued or active (a page should
  close its EventSource then). A resumed run re-logs no step it checkpointed, but a run resumed
  after a crash re-logs the steps after its last checkpoint: keep the latest record per step.
- ``GET /api/runs/{id}/log?tail=<lines>`` -> {text}
- ``POST /api/chat`` {run_id | null, messages, max_tokens?, temperature?, adapter? (default true:
  false answers with the run's base model), model? (with run_id null: a workspace model path;
  default the built-in model)} -> text/event-stream ``data: {"delta": "..."}`` ... ``data: [DONE]``
  (an ``{"error": "..."}`` event on failure)
- ``POST /api/runs/{id}/export`` {kind: merge | gguf, outtype?, pre_tokenizer?} -> Job {id, kind, status (running |
  finished | failed), run_id, log_tail, output, message}; ``GET /api/jobs`` -> {jobs};
  ``GET /api/jobs/{id}`` -> Job; ``GET /api/jobs/{id}/download`` -> the file (a dir is zipped)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from lorafuse.errors import LorafuseError
from lorafuse.ui import form
from lorafuse.ui.errors import BadRequest, UIError
from lorafuse.ui.runs import ACTIVE, RunManager
from lorafuse.ui.security import Guard, relative, resolve_in

STATIC = Path(__file__).resolve().parent / "static"
HEARTBEAT_S = 15.0


def create_app(workspace: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 7860,
               token: str | None = None, stop_timeout: float = 60.0, poll_interval: float = 0.5,
               heartbeat_s: float = HEARTBEAT_S) -> FastAPI:  # fmt: skip
    """The app for ``workspace``. ``token``: required on /api (None = no token: loopback only)."""
    from lorafuse.ui.chat import ChatServers
    from lorafuse.ui.jobs import JobManager

    root = Path(workspace).resolve()
    root.mkdir(parents=True, exist_ok=True)
    runs = RunManager(root, stop_timeout=stop_timeout, poll_interval=poll_interval)
    jobs = JobManager(root, runs)
    runs.on_tick.append(jobs.tick)
    chats = ChatServers(root, runs)
    guard = Guard(host, port, token)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        runs.start()
        try:
            yield
        finally:
            runs.close()
            chats.close()

    app = FastAPI(title="lorafuse ui", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runs, app.state.jobs, app.state.chats, app.state.guard = runs, jobs, chats, guard

    @app.exception_handler(LorafuseError)
    async def _error(_req, err: LorafuseError):
        status = err.status if isinstance(err, UIError) else 400
        return JSONResponse({"detail": str(err)}, status_code=status)

    @app.middleware("http")
    async def _checks(request: Request, call_next):
        try:
            guard.check_host(request.headers.get("host"))
            if request.url.path.startswith("/api"):
                guard.check_token(
                    request.headers.get("authorization"), request.query_params.get("token")
                )
                guard.check_origin(
                    request.method, request.headers.get("origin"), request.headers.get("host")
                )
        except UIError as err:
            return JSONResponse({"detail": str(err)}, status_code=err.status)
        return await call_next(request)

    async def body(request: Request) -> dict:
        try:
            data = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body must be JSON") from None
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        return data

    def config_or_422(values, need_data: bool = True):
        cfg, errors = form.check(values, root, need_data=need_data)
        if errors:
            detail = "; ".join(e["message"] for e in errors)
            raise _Unprocessable(detail, errors)
        return cfg

    @app.exception_handler(UIError)
    async def _ui_error(_req, err: UIError):
        content = {"detail": str(err)}
        if isinstance(err, _Unprocessable):
            content["errors"] = err.errors
        return JSONResponse(content, status_code=err.status)

    # ---- machine, config, files ----------------------------------------------------------------
    @app.get("/api/info")
    def info():
        import platform

        import psutil

        from lorafuse import __version__
        from lorafuse.ui.estimate import default_device

        vm = psutil.virtual_memory()
        return {"version": __version__, "workspace": str(root), "host": host,
                "cpu": f"{platform.processor() or platform.machine()} x {os.cpu_count()}",
                "free_mem_mb": round(vm.available / 2**20, 1), "total_mem_mb": round(vm.total / 2**20, 1),
                "device": default_device(), "token_required": token is not None}  # fmt: skip

    @app.get("/api/config/schema")
    def config_schema():
        return form.schema()

    @app.post("/api/config/validate")
    async def validate(request: Request):
        values = (await body(request)).get("config", {})
        cfg, errors = form.check(values, root)
        if errors:
            return {"ok": False, "errors": errors, "config": None, "cli": None, "yaml": None}
        resolved = cfg.to_dict()
        for name in form.UI_OWNED:
            resolved.pop(name, None)
        return {"ok": True, "errors": [], "config": resolved, "cli": form.to_cli(cfg),
                "yaml": form.to_yaml(cfg)}  # fmt: skip

    @app.get("/api/files")
    def files(dir: str = ""):  # noqa: A002 - the API's parameter name
        path = resolve_in(root, dir, must_exist=True) if dir else root
        if not path.is_dir():
            raise BadRequest(f"{dir}: not a directory")
        entries = []
        for child in sorted(path.iterdir(), key=lambda p: (not p.is_dir(), p.name.lower())):
            if child.name.startswith("."):
                continue
            real = child.resolve()
            if real != root and root not in real.parents:
                continue  # a symlink out of the workspace is not offered
            entries.append({"name": child.name, "path": relative(root, real), "is_dir": real.is_dir(),
                            "size": real.stat().st_size if real.is_file() else None})  # fmt: skip
        return {"dir": relative(root, path) if path != root else "", "entries": entries}

    @app.post("/api/dataset/preview")
    async def dataset_preview(request: Request):
        from lorafuse.ui.preview import preview

        data = await body(request)
        path = form.resolve_data(str(data.get("path", "")), root)
        model = form.resolve_model(data.get("model") or None, root)
        import anyio

        options = form.read_options(data)
        return await anyio.to_thread.run_sync(lambda: preview(
            path, root, data_format=data.get("data_format") or "auto",
            max_seq_length=int(data.get("max_seq_length") or 2048), model=model,
            too_long=data.get("too_long") or "truncate", options=options,
            think_tokens=data.get("think_tokens") or "mask-empty"))  # fmt: skip

    @app.post("/api/estimate")
    async def estimate(request: Request):
        from lorafuse.ui.estimate import estimate as run_estimate

        cfg = config_or_422((await body(request)).get("config", {}), need_data=False)
        import anyio

        return await anyio.to_thread.run_sync(run_estimate, cfg, runs)

    # ---- runs -------------------------------------------------------------------------------------
    @app.get("/api/runs")
    def list_runs():
        return {"runs": runs.list()}

    @app.post("/api/runs", status_code=201)
    async def create_run(request: Request):
        data = await body(request)
        cfg = config_or_422(data.get("config", {}))
        return runs.create(cfg, data.get("name") or None)

    @app.get("/api/runs/{run_id}")
    def get_run(run_id: str):
        return runs.view(run_id, with_config=True)

    @app.post("/api/runs/{run_id}/stop")
    def stop_run(run_id: str):
        return runs.stop(run_id)

    @app.post("/api/runs/{run_id}/resume")
    def resume_run(run_id: str):
        return runs.resume(run_id)

    @app.post("/api/runs/{run_id}/cancel")
    def cancel_run(run_id: str):
        return runs.cancel(run_id)

    @app.get("/api/runs/{run_id}/metrics")
    def metrics(run_id: str, after: float = -1):
        return {"records": [r for r in runs.records(run_id) if r.get("step", 0) > after]}

    @app.get("/api/runs/{run_id}/log")
    def log(run_id: str, tail: int = 200):
        return {"text": runs.log_tail(run_id, max(1, min(tail, 5000)))}

    @app.get("/api/runs/{run_id}/events")
    async def events(run_id: str, request: Request, last_event_id: str | None = None):
        runs.get(run_id)
        raw = request.headers.get("last-event-id") or last_event_id
        try:
            after = float(raw) if raw not in (None, "") else -1.0
        except ValueError:
            raise BadRequest(f"Last-Event-ID {raw!r} is not a step number") from None
        return StreamingResponse(
            _event_stream(runs, run_id, after, request, poll_interval, heartbeat_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # ---- chat and export ------------------------------------------------------------------------
    @app.post("/api/chat")
    async def chat(request: Request):
        data = await body(request)
        if data.get("run_id") is None:
            data["model"] = form.resolve_model(data.get("model") or None, root)
        stream = await chats.stream(data)
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.post("/api/runs/{run_id}/export", status_code=201)
    async def export(run_id: str, request: Request):
        data = await body(request)
        return jobs.create(
            run_id, str(data.get("kind", "")), data.get("outtype"), data.get("pre_tokenizer")
        )

    @app.get("/api/jobs")
    def list_jobs():
        return {"jobs": jobs.list()}

    @app.get("/api/jobs/{job_id}")
    def get_job(job_id: str):
        return jobs.view(job_id)

    @app.get("/api/jobs/{job_id}/download")
    def download(job_id: str):
        path = jobs.download_path(job_id)
        return FileResponse(path, filename=f"{job_id}-{path.name}")

    # ---- the page -------------------------------------------------------------------------------
    @app.get("/")
    def index():
        page = STATIC / "index.html"
        if not page.is_file():
            return JSONResponse({"detail": "the page is not installed (lorafuse/ui/static)"}, 404)
        return FileResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/static/{name:path}")
    def static(name: str):
        path = resolve_in(STATIC, name) if STATIC.is_dir() else None
        if path is None or not path.is_file():
            return JSONResponse({"detail": f"no static file {name!r}"}, 404)
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    return app


class _Unprocessable(UIError):
    """Config errors: 422 with the list of {field, message} next to ``detail``."""

    status = 422

    def __init__(self, detail: str, errors: list[dict]) -> None:
        super().__init__(detail)
        self.errors = errors


async def _event_stream(runs: RunManager, run_id: str, after: float, request: Request,
                        poll: float, heartbeat_s: float):  # fmt: skip
    """SSE of one run: metrics records after ``after`` and status changes (module docstring)."""
    sent = 0
    last_state = None
    last_beat = time.monotonic()
    yield "retry: 3000\n\n"
    while True:
        view = runs.view(run_id)  # first: a final status implies every record is already on disk
        records = runs.records(run_id)
        for rec in records[sent:]:
            if rec.get("step", 0) > after:
                yield f"id: {rec.get('step', 0)}\nevent: metrics\ndata: {json.dumps(rec)}\n\n"
        sent = len(records)
        state = (view["status"], view["last_checkpoint_step"], view["queue_position"])
        if state != last_state:
            last_state = state
            yield f"event: status\ndata: {json.dumps(view)}\n\n"
        if view["status"] not in (*ACTIVE, "queued"):
            return
        if time.monotonic() - last_beat > heartbeat_s:
            last_beat = time.monotonic()
            yield ": heartbeat\n\n"
        if await request.is_disconnected():
            return
        await asyncio.sleep(poll)
