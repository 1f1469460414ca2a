from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

KEY = "sk-test-123"


@pytest.fixture(scope="session")
def tiny_ws(tmp_path_factory):
    """Tiny random Llama + tokenizer + two adapters + a checkpoint dir (lorafuse.testing)."""
    from lorafuse.testing import make_tiny_workspace

    return make_tiny_workspace(tmp_path_factory.mktemp("tiny_ws"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args: list[str], api_key: str | None = KEY):
    """``lorafuse serve ARGS`` in a subprocess on a free port; yields (url, openai client)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "lorafuse", "serve", *args, "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "LORAFUSE_API_KEY"}
    if api_key:
        env["LORAFUSE_API_KEY"] = api_key
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("server did not start in 90 s")
    try:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="session")
def launch_server():
    """``running_server``: ``with launch_server(ARGS, api_key=KEY) as (url, client): ...``"""
    return running_server
