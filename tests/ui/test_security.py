"""Token, Host and Origin checks, and workspace-only paths (lorafuse.ui.security)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from lorafuse.commands.ui import page_url  # noqa: E402
from lorafuse.ui.app import create_app  # noqa: E402
from lorafuse.ui.errors import BadRequest, Forbidden  # noqa: E402
from lorafuse.ui.security import is_loopback, resolve_in, resolve_token  # noqa: E402

LOCAL = "http://127.0.0.1:7860"


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    (root / "data").mkdir(parents=True)
    (root / "data" / "a.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "secret.jsonl").write_text('{"text": "outside"}\n')
    os.symlink(tmp_path, root / "escape")  # a link that leads out of the workspace
    os.symlink(root / "data" / "a.jsonl", root / "inside.jsonl")  # one that stays in
    return root


def test_token_required_off_loopback(ws):
    app = create_app(ws, host="10.1.2.3", port=7860, token="s3cret")
    with TestClient(app, base_url="http://10.1.2.3:7860") as client:
        assert client.get("/api/info").status_code == 401
        assert client.get("/api/info", headers={"Authorization": "Bearer nope"}).status_code == 403
        assert client.get("/api/info", params={"token": "nope"}).status_code == 403
        ok = client.get("/api/info", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["token_required"] is True
        assert client.get("/api/runs", params={"token": "s3cret"}).status_code == 200
        # the event stream authenticates through the query (EventSource cannot set headers)
        r = client.get("/api/runs/none/events", params={"token": "s3cret"})
        assert r.status_code == 404 and "no run" in r.json()["detail"]
        assert client.get("/api/runs/none/events").status_code == 401
        wrong_host = client.get("/api/info", params={"token": "s3cret"},
                                headers={"Host": "attacker.example"})  # fmt: skip
        assert wrong_host.status_code == 403


def test_loopback_needs_no_token_but_checks_host_and_origin(ws):
    with TestClient(create_app(ws), base_url=LOCAL) as client:
        assert client.get("/api/info").status_code == 200
        rebinding = client.get("/api/info", headers={"Host": "evil.example:7860"})
        assert rebinding.status_code == 403 and "Host" in rebinding.json()["detail"]
        body = {"config": {"data": ["data/a.jsonl"]}}
        foreign = client.post("/api/config/validate", json=body,
                              headers={"Origin": "http://evil.example"})  # fmt: skip
        assert foreign.status_code == 403 and "Origin" in foreign.json()["detail"]
        same = client.post("/api/config/validate", json=body, headers={"Origin": LOCAL})
        assert same.status_code == 200 and same.json()["ok"], same.text
        # reading is not state-changing: a foreign Origin on GET is left to the browser's CORS
        assert client.get("/api/runs", headers={"Origin": "http://evil.example"}).status_code == 200


def test_paths_stay_in_the_workspace(ws):
    with TestClient(create_app(ws), base_url=LOCAL) as client:
        assert client.get("/api/files", params={"dir": "../"}).status_code == 400
        assert client.get("/api/files", params={"dir": "data/../.."}).status_code == 400
        assert client.get("/api/files", params={"dir": "/etc"}).status_code == 403
        assert client.get("/api/files", params={"dir": "escape"}).status_code == 403
        names = {e["name"] for e in client.get("/api/files").json()["entries"]}
        assert "escape" not in names and {"data", "inside.jsonl"} <= names
        for path in ("../secret.jsonl", "escape/secret.jsonl", str(ws.parent / "secret.jsonl")):
            r = client.post("/api/dataset/preview", json={"path": path})
            assert r.status_code in (400, 403), (path, r.text)
        v = client.post("/api/config/validate",
                        json={"config": {"data": ["escape/secret.jsonl"]}}).json()  # fmt: skip
        assert not v["ok"] and v["errors"][0]["field"] == "data"
        assert "outside the workspace" in v["errors"][0]["message"]
        r = client.post("/api/runs", json={"config": {"data": ["../secret.jsonl"]}})
        assert r.status_code == 422
        r = client.post("/api/runs", json={"config": {"data": ["data/a.jsonl"], "model": "/etc"}})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "model"
        assert client.get("/api/jobs/../../x").status_code == 404


def test_resolve_in_and_tokens(ws):
    assert resolve_in(ws, "data/a.jsonl") == (ws / "data" / "a.jsonl").resolve()
    assert resolve_in(ws, "inside.jsonl") == (ws / "data" / "a.jsonl").resolve()
    assert resolve_in(ws, str(ws / "data")) == (ws / "data").resolve()
    for bad, err in (("..", BadRequest), ("a/../../b", BadRequest), ("", BadRequest),
                     ("x\x00y", BadRequest), ("/etc/passwd", Forbidden),
                     ("escape/secret.jsonl", Forbidden)):  # fmt: skip
        with pytest.raises(err):
            resolve_in(ws, bad)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    assert resolve_token("127.0.0.1", None) is None
    generated = resolve_token("0.0.0.0", None)
    assert generated and len(generated) >= 24 and generated != resolve_token("0.0.0.0", None)
    assert resolve_token("0.0.0.0", "mine") == "mine"
    assert page_url("0.0.0.0", 7860, "abc") == "http://127.0.0.1:7860/?token=abc"
    assert page_url("127.0.0.1", 7860, None) == "http://127.0.0.1:7860/"
