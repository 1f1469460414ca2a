"""The FastAPI app of ``lorafuse ui``: the HTTP API (the page's contract) and the static page.

Module-level handlers on one :data:`router`, reading the workspace's managers from
``app.state.ui`` (:class:`UIState`). Auth: a loopback bind without ``--token`` needs none;
otherwise every ``/api`` call needs it (missing -> 401, wrong -> 403), the Host must name the
bound host, a foreign Origin on a state change -> 403. Errors are ``{detail}``. Every route, body
and answer: docs/ui.md (HTTP API).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from lorafuse.errors import LorafuseError
from lorafuse.ui import form
from lorafuse.ui.errors import BadRequest, UIError
from lorafuse.ui.runs import ACTIVE, RunManager
from lorafuse.ui.security import Guard, relative, resolve_in

if TYPE_CHECKING:  # imported when an app is made: they pull in the chat server's stack
    from lorafuse.ui.chat import ChatServers
    from lorafuse.ui.jobs import JobManager

STATIC = Path(__file__).resolve().parent / "static"
HEARTBEAT_S = 15.0


router = APIRouter()


@dataclass
class UIState:
    """What every handler reads (``app.state.ui``): the workspace and its managers."""

    root: Path
    host: str
    token: str | None
    runs: RunManager
    jobs: JobManager
    chats: ChatServers
    guard: Guard
    poll_interval: float
    heartbeat_s: float


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
    chats, guard = ChatServers(root, runs), Guard(host, port, token)
    state = UIState(root, host, token, runs, jobs, chats, guard, poll_interval, heartbeat_s)
    app = FastAPI(title="lorafuse ui", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.ui = state
    # the managers by name too (tests and callers read app.state.chats...)
    app.state.runs, app.state.jobs, app.state.chats, app.state.guard = runs, jobs, chats, guard
    app.add_exception_handler(LorafuseError, _error)
    app.add_exception_handler(UIError, _ui_error)
    app.middleware("http")(_checks)
    app.include_router(router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    ui: UIState = app.state.ui
    ui.runs.start()
    try:
        yield
    finally:
        ui.runs.close()
        ui.chats.close()


def _state(request: Request) -> UIState:
    return request.app.state.ui


UI = Annotated[UIState, Depends(_state)]


# ---- errors, access, bodies ------------------------------------------------------------------


async def _error(_req, err: LorafuseError):
    status = err.status if isinstance(err, UIError) else 400
    return JSONResponse({"detail": str(err)}, status_code=status)


async def _ui_error(_req, err: UIError):
    content = {"detail": str(err)}
    if isinstance(err, _Unprocessable):
        content["errors"] = err.errors
    return JSONResponse(content, status_code=err.status)


async def _checks(request: Request, call_next):
    guard = _state(request).guard
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


def config_or_422(ui: UIState, values, need_data: bool = True):
    cfg, errors = form.check(values, ui.root, need_data=need_data)
    if errors:
        detail = "; ".join(e["message"] for e in errors)
        raise _Unprocessable(detail, errors)
    return cfg


# ---- machine, config, files ------------------------------------------------------------------


@router.get("/api/info")
def info(ui: UI):
    import platform

    import psutil

    from lorafuse import __version__
    from lorafuse.ui.estimate import default_device

    vm = psutil.virtual_memory()
    return {"version": __version__, "workspace": str(ui.root), "host": ui.host,
            "cpu": f"{platform.processor() or platform.machine()} x {os.cpu_count()}",
            "free_mem_mb": round(vm.available / 2**20, 1), "total_mem_mb": round(vm.total / 2**20, 1),
            "device": default_device(), "token_required": ui.token is not None}  # fmt: skip


@router.get("/api/config/schema")
def config_schema():
    return form.schema()


@router.post("/api/config/validate")
async def validate(request: Request, ui: UI):
    values = (await body(request)).get("config", {})
    cfg, errors = form.check(values, ui.root)
    if errors:
        return {"ok": False, "errors": errors, "config": None, "cli": None, "yaml": None}
    resolved = cfg.to_dict()
    for name in form.UI_OWNED:
        resolved.pop(name, None)
    return {"ok": True, "errors": [], "config": resolved, "cli": form.to_cli(cfg),
            "yaml": form.to_yaml(cfg)}  # fmt: skip


@router.get("/api/files")
def files(ui: UI, dir: str = ""):  # noqa: A002 - the API's parameter name
    root = ui.root
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


@router.post("/api/dataset/preview")
async def dataset_preview(request: Request, ui: UI):
    import anyio

    from lorafuse.ui.preview import preview

    data = await body(request)
    path = form.resolve_data(str(data.get("path", "")), ui.root)
    model = form.resolve_model(data.get("model") or None, ui.root)
    options = form.read_options(data)
    return await anyio.to_thread.run_sync(lambda: preview(
        path, ui.root, data_format=data.get("data_format") or "auto",
        max_seq_length=int(data.get("max_seq_length") or 2048), model=model,
        too_long=data.get("too_long") or "truncate", options=options,
        think_tokens=data.get("think_tokens") or "mask-empty"))  # fmt: skip


@router.post("/api/estimate")
async def estimate(request: Request, ui: UI):
    import anyio

    from lorafuse.ui.estimate import estimate as run_estimate

    cfg = config_or_422(ui, (await body(request)).get("config", {}), need_data=False)
    return await anyio.to_thread.run_sync(run_estimate, cfg, ui.runs)


# ---- runs ------------------------------------------------------------------------------------


@router.get("/api/runs")
def list_runs(ui: UI):
    return {"runs": ui.runs.list()}


@router.post("/api/runs", status_code=201)
async def create_run(request: Request, ui: UI):
    data = await body(request)
    cfg = config_or_422(ui, data.get("config", {}))
    return ui.runs.create(cfg, data.get("name") or None)


@router.get("/api/runs/{run_id}")
def get_run(run_id: str, ui: UI):
    return ui.runs.view(run_id, with_config=True)


@router.post("/api/runs/{run_id}/stop")
def stop_run(run_id: str, ui: UI):
    return ui.runs.stop(run_id)


@router.post("/api/runs/{run_id}/resume")
def resume_run(run_id: str, ui: UI):
    return ui.runs.resume(run_id)


@router.post("/api/runs/{run_id}/cancel")
def cancel_run(run_id: str, ui: UI):
    return ui.runs.cancel(run_id)


@router.get("/api/runs/{run_id}/metrics")
def metrics(run_id: str, ui: UI, after: float = -1):
    return {"records": [r for r in ui.runs.records(run_id) if r.get("step", 0) > after]}


@router.get("/api/runs/{run_id}/log")
def log(run_id: str, ui: UI, tail: int = 200):
    return {"text": ui.runs.log_tail(run_id, max(1, min(tail, 5000)))}


@router.get("/api/runs/{run_id}/events")
async def events(run_id: str, request: Request, ui: UI, last_event_id: str | None = None):
    ui.runs.get(run_id)
    raw = request.headers.get("last-event-id") or last_event_id
    try:
        after = float(raw) if raw not in (None, "") else -1.0
    except ValueError:
        raise BadRequest(f"Last-Event-ID {raw!r} is not a step number") from None
    return StreamingResponse(
        _event_stream(ui.runs, run_id, after, request, ui.poll_interval, ui.heartbeat_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# ---- chat and export -------------------------------------------------------------------------


@router.post("/api/chat")
async def chat(request: Request, ui: UI):
    data = await body(request)
    if data.get("run_id") is None:
        data["model"] = form.resolve_model(data.get("model") or None, ui.root)
    stream = await ui.chats.stream(data)
    return StreamingResponse(stream, media_type="text/event-stream")


@router.post("/api/runs/{run_id}/export", status_code=201)
async def export(run_id: str, request: Request, ui: UI):
    data = await body(request)
    return ui.jobs.create(
        run_id, str(data.get("kind", "")), data.get("outtype"), data.get("pre_tokenizer")
    )


@router.get("/api/jobs")
def list_jobs(ui: UI):
    return {"jobs": ui.jobs.list()}


@router.get("/api/jobs/{job_id}")
def get_job(job_id: str, ui: UI):
    return ui.jobs.view(job_id)


@router.get("/api/jobs/{job_id}/download")
def download(job_id: str, ui: UI):
    path = ui.jobs.download_path(job_id)
    return FileResponse(path, filename=f"{job_id}-{path.name}")


# ---- the page --------------------------------------------------------------------------------


@router.get("/")
def index():
    page = STATIC / "index.html"
    if not page.is_file():
        return JSONResponse({"detail": "the page is not installed (lorafuse/ui/static)"}, 404)
    return FileResponse(page, headers={"Cache-Control": "no-cache"})


@router.get("/static/{name:path}")
def static(name: str):
    path = resolve_in(STATIC, name) if STATIC.is_dir() else None
    if path is None or not path.is_file():
        return JSONResponse({"detail": f"no static file {name!r}"}, 404)
    return FileResponse(path, headers={"Cache-Control": "no-cache"})


class _Unprocessable(UIError):
    """Config errors: 422 with the list of {field, message} next to ``detail``."""

    status = 422

    def __init__(self, detail: str, errors: list[dict]) -> None:
        super().__init__(detail)
        self.errors = errors


async def _event_stream(runs: RunManager, run_id: str, after: float, request: Request,
                        poll: float, heartbeat_s: float):  # fmt: skip
    """SSE of one run: metrics records after ``after`` and status changes (docs/ui.md, HTTP API)."""
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
