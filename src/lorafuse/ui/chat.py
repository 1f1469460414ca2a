"""Chat with a run's adapter (or a base model) through ``lorafuse serve`` subprocesses.

One server per base model + adapter: ``python -m lorafuse serve --checkpoint <adapter dir>
--base-name base`` (or ``--model M`` for a bare base) on a free port of 127.0.0.1, started on first
use, reused afterwards, stopped when the UI shuts down. A server of a run serves both model ids,
``base`` and ``adapter``, so base-vs-adapter side by side costs one process. Replies are streamed
from the server's OpenAI-compatible ``/v1/chat/completions`` (``stream: true``) and passed on
as ``data: {"delta": "..."}`` events, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from lorafuse.train.checkpoint import list_checkpoints
from lorafuse.ui.errors import BadRequest, Conflict, UIError
from lorafuse.ui.processes import child_env, read_tail

START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChatServers:
    """``lorafuse serve`` processes keyed by (model, adapter dir)."""

    def __init__(self, workspace: str | Path, runs) -> None:
        self.workspace = Path(workspace).resolve()
        self.dir = self.workspace / "chat"
        self.runs = runs
        self.lock = threading.Lock()
        self.servers: dict[tuple, dict] = {}

    def target(self, run_id: str | None, model: str | None) -> tuple[tuple, list[str]]:
        """(key, serve arguments) for a run's adapter (final/ or latest checkpoint) or a base model."""
        if run_id is None:
            return ("model", model), (["--model", model] if model else [])
        self.runs.get(run_id)
        out = self.runs.run_dir(run_id) / "out"
        adapter = out / "final"
        if not adapter.is_dir():
            ckpts = list_checkpoints(str(out))
            if not ckpts:
                raise Conflict(f"run {run_id} has no adapter yet (no final/ and no checkpoint)")
            adapter = Path(ckpts[-1][1])
        return ("adapter", str(adapter)), ["--checkpoint", str(adapter)]

    def url_for(self, key: tuple, args: list[str]) -> str:
        """The base URL of a running server for ``key`` (started now if needed; blocking)."""
        import httpx

        with self.lock:
            server = self.servers.get(key)
            if server is not None and server["proc"].poll() is None:
                return server["url"]
            self.dir.mkdir(parents=True, exist_ok=True)
            port = free_port()
            log_path = self.dir / f"serve-{port}.log"
            cmd = [sys.executable, "-m", "lorafuse", "serve", *args, "--base-name", "base",
                   "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=child_env())  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + START_TIMEOUT_S
            while time.time() < deadline:
                if proc.poll() is not None:
                    tail = read_tail(log_path, 2000).decode("utf-8", "replace")
                    raise UIError(
                        f"lorafuse serve exited with status {proc.returncode}: {tail[-600:]}"
                    )
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            else:
                proc.kill()
                raise UIError(
                    f"lorafuse serve did not start in {START_TIMEOUT_S:.0f} s (log: {log_path})"
                )
            self.servers[key] = {"proc": proc, "url": url, "log": str(log_path)}
            return url

    async def stream(self, body: dict):
        """Yield SSE lines for one chat request (see the module docstring)."""
        import anyio
        import httpx

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: a non-empty list of {role, content}")
        run_id = body.get("run_id")
        key, args = self.target(run_id, body.get("model"))
        use_adapter = run_id is not None and body.get("adapter", True)
        url = await anyio.to_thread.run_sync(self.url_for, key, args)
        payload = {"model": "adapter" if use_adapter else "base", "messages": messages, "stream": True,
                   "max_tokens": int(body.get("max_tokens") or 256),
                   "temperature": float(body.get("temperature") or 0.0)}  # fmt: skip

        async def events():
            try:
                async with httpx.AsyncClient(timeout=None) as client:
                    async with client.stream(
                        "POST", url + "/v1/chat/completions", json=payload
                    ) as r:
                        if r.status_code != 200:
                            text = (await r.aread()).decode("utf-8", "replace")
                            yield _event({"error": f"serve answered {r.status_code}: {text[:500]}"})
                            return
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            for choice in chunk.get("choices", []):
                                delta = (choice.get("delta") or {}).get("content")
                                if delta:
                                    yield _event({"delta": delta})
            except httpx.HTTPError as err:
                yield _event({"error": f"lost the model server: {err}"})
            yield "data: [DONE]\n\n"

        return events()

    def close(self) -> None:
        with self.lock:
            for server in self.servers.values():
                proc = server["proc"]
                if proc.poll() is None:
                    proc.terminate()
            for server in self.servers.values():
                try:
                    server["proc"].wait(timeout=15)
                except subprocess.TimeoutExpired:
                    server["proc"].kill()
                    server["proc"].wait()
            self.servers.clear()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
