"""`lorafuse ui`: the web UI (FastAPI + one static page) over a workspace of runs.

lorafuse ui                                   # http://127.0.0.1:7860, workspace ./lorafuse-ui
lorafuse ui --host 0.0.0.0 --port 8080        # reachable from other machines: a token is printed
"""

from __future__ import annotations

import argparse

from lorafuse.errors import LorafuseError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="bind address (other than loopback: token)"
    )
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument(
        "--workspace", default="lorafuse-ui",
        help="directory of runs, exports and the data/model files the page may use",
    )  # fmt: skip
    parser.add_argument(
        "--token", default=None,
        help="require this token on every API call (default: none on loopback, else a random one)",
    )  # fmt: skip
    parser.add_argument(
        "--stop-timeout", type=float, default=60.0,
        help="seconds between Stop's SIGTERM (checkpoint, then exit) and a SIGKILL",
    )  # fmt: skip
    parser.add_argument("--log-level", default="warning")


def page_url(host: str, port: int, token: str | None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from lorafuse.ui.app import create_app
    except ImportError as err:
        raise LorafuseError(
            f"ui needs fastapi and uvicorn: pip install 'lorafuse[ui]' ({err})"
        ) from err
    from lorafuse.ui.security import resolve_token

    token = resolve_token(args.host, args.token)
    app = create_app(args.workspace, host=args.host, port=args.port, token=token,
                     stop_timeout=args.stop_timeout)  # fmt: skip
    print(f"lorafuse ui: workspace {app.state.runs.workspace}", flush=True)
    print(f"lorafuse ui: open {page_url(args.host, args.port, token)}", flush=True)
    # event streams never end on their own: give open connections 5 s at shutdown, then close
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)  # fmt: skip
    return 0
