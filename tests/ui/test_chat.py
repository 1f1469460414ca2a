"""Chat through a `lorafuse serve` subprocess started (and reused) by the UI."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from lorafuse.ui.app import create_app  # noqa: E402

pytestmark = pytest.mark.slow  # one model server start (~10 s)


def chat(client, body):
    events = []
    with client.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]", events
    parsed = [json.loads(e) for e in events[:-1]]
    assert not [e for e in parsed if "error" in e], parsed
    return "".join(e["delta"] for e in parsed)


def test_chat_with_a_base_model_streams_text(tmp_path):
    from lorafuse.testing import save_tiny_model

    ws = tmp_path / "ws"
    save_tiny_model(ws / "model")
    app = create_app(ws)
    with TestClient(app, base_url="http://127.0.0.1:7860") as client:
        body = {"run_id": None, "model": "model", "max_tokens": 8,
                "messages": [{"role": "user", "content": "hello world"}]}  # fmt: skip
        first = chat(client, body)
        assert first  # the tiny model's greedy reply: non-empty text
        assert chat(client, body) == first  # greedy, and the same (reused) server
        assert len(app.state.chats.servers) == 1
        proc = next(iter(app.state.chats.servers.values()))["proc"]
        assert client.post("/api/chat", json={**body, "messages": []}).status_code == 400
    assert proc.poll() is not None  # stopped with the UI
    shutil.rmtree(ws)
