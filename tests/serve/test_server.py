"""`lorafuse serve` end to end: a real server process driven by the official openai client."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from lorafuse.generation import encode_messages, encode_prompt
from lorafuse.testing import save_tiny_adapter, save_tiny_model

KEY = "sk-test-123"
pytestmark = pytest.mark.slow


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    # long context so the disconnect test can ask for thousands of tokens
    save_tiny_model(root / "base", max_position_embeddings=4096)
    save_tiny_adapter(root / "base", root / "a", seed=1)
    save_tiny_adapter(root / "base", root / "b", seed=2, target_modules=["q_proj", "v_proj"])
    args = ["--model", str(root / "base"), "--adapter", f"a={root / 'a'}", "--adapter",
            f"b={root / 'b'}", "--base-name", "base", "--max-body-bytes", "20000"]  # fmt: skip
    with running_server(args) as (url, client):
        yield {"url": url, "root": root, "client": client}


@pytest.fixture(scope="module")
def reference(server):
    """In-process greedy references: base, base+a, base+b."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = server["root"]
    tok = AutoTokenizer.from_pretrained(root / "base")
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, root / "a", adapter_name="a")
    model.load_adapter(root / "b", adapter_name="b")

    def greedy(model_id, ids, n):
        ctx = model.disable_adapter() if model_id == "base" else contextlib.nullcontext()
        if model_id != "base":
            model.set_adapter(model_id)
        with ctx, torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        new = out[0, len(ids) :].tolist()
        return tok.decode(new, skip_special_tokens=True), new

    return tok, greedy


MSG = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_and_health(server):
    ids = [m.id for m in server["client"].models.list().data]
    assert ids == ["base", "a", "b"]
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"  # no key needed


@pytest.mark.parametrize("model_id", ["base", "a", "b"])
def test_chat_matches_reference_and_streams(server, reference, model_id):
    tok, greedy = reference
    client = server["client"]
    ids = encode_messages(tok, MSG)
    want, new = greedy(model_id, ids, 12)
    r = client.chat.completions.create(model=model_id, messages=MSG, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(new)
    chunks = list(client.chat.completions.create(model=model_id, messages=MSG, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert (
        chunks[-2].choices[0].finish_reason in ("stop", "length")
        and chunks[-1].usage.total_tokens == r.usage.total_tokens
    )


def test_adapters_differ_and_seeded_sampling(server):
    client = server["client"]
    outs = {m: client.chat.completions.create(model=m, messages=MSG, max_tokens=8, temperature=0).choices[0].message.content
            for m in ("base", "a", "b")}  # fmt: skip
    assert len(set(outs.values())) == 3
    kw = dict(model="a", messages=MSG, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert (
        client.chat.completions.create(**kw).choices[0].message.content
        == client.chat.completions.create(**kw).choices[0].message.content
    )


def test_completions_stop_and_stream(server, reference):
    tok, greedy = reference
    client = server["client"]
    want, _ = greedy("a", encode_prompt(tok, "The quick brown"), 10)
    r = client.completions.create(model="a", prompt="The quick brown", max_tokens=10, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="a", prompt="The quick brown", max_tokens=10, temperature=0, stream=True))  # fmt: skip
    assert streamed == want
    stop = want[
        3:5
    ]  # a stop string taken from the known output: generation must end right before it
    r = client.completions.create(
        model="a", prompt="The quick brown", max_tokens=10, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == want[: want.find(stop)] and r.choices[0].finish_reason == "stop"


def test_auth(server):
    bad = openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server["url"] + "/v1/chat/completions", json={"model": "base", "messages": MSG})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_bad_requests_get_openai_errors(server):
    client, url = server["client"], server["url"] + "/v1/chat/completions"
    hdr = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    cases = {
        b"{not json": 400,
        json.dumps({"model": "base", "messages": "hi"}).encode(): 400,
        json.dumps({"model": "base", "messages": MSG, "max_tokens": "many"}).encode(): 400,
        json.dumps({"model": "base", "messages": MSG, "temperature": 9}).encode(): 400,
        json.dumps({"model": "base", "messages": MSG, "max_tokens": 5000}).encode(): 400,
        json.dumps(
            {"model": "base", "messages": [{"role": "user", "content": "x" * 30000}]}
        ).encode(): 413,
    }
    for body, status in cases.items():
        r = httpx.post(url, content=body, headers=hdr)
        assert r.status_code == status, (body[:60], r.text)
        assert set(r.json()["error"]) >= {"message", "type", "code"}
    assert (
        httpx.post(url, content=b"{not json", headers=hdr).json()["error"]["code"] == "invalid_json"
    )
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="base", messages=MSG, max_tokens=5000)
    # still serving
    assert (
        client.chat.completions.create(
            model="base", messages=MSG, max_tokens=2
        ).usage.completion_tokens
        >= 1
    )


def test_concurrent_requests_do_not_mix(server):
    client = server["client"]
    jobs = [
        ("base", "hello"),
        ("a", "hello"),
        ("b", "hello"),
        ("a", "answer"),
        ("base", "answer"),
        ("b", "0123"),
    ] * 2

    def ask(job):
        m, text = job
        msgs = [{"role": "user", "content": text}]
        return (
            client.chat.completions.create(model=m, messages=msgs, max_tokens=10, temperature=0)
            .choices[0]
            .message.content
        )

    sequential = [ask(j) for j in jobs[:6]]
    with cf.ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(ask, jobs))
    assert parallel == sequential * 2


def test_disconnect_mid_stream_frees_the_worker(server):
    url, hdr = server["url"], {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(url + "/health").json()["cancelled"]
    body = {
        "model": "a",
        "messages": MSG,
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=hdr, timeout=30
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.time() + 10
    while time.time() < deadline:
        h = httpx.get(url + "/health").json()
        if h["cancelled"] > before and not h["busy"]:
            break
        time.sleep(0.1)
    assert h["cancelled"] == before + 1, h
    assert h["last_cancelled_tokens"] < 4000  # generation stopped early, not run to max_tokens
    # The server is free again: a new request is answered in full.
    reply = server["client"].chat.completions.create(
        model="b", messages=MSG, max_tokens=4, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= 4


def _answers_plain_and_streamed(client, model_id: str, want: str) -> None:
    r = client.chat.completions.create(model=model_id, messages=MSG, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want
    chunks = client.chat.completions.create(
        model=model_id, messages=MSG, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_base_only_server_answers(server, reference):
    """No adapter at all: the model is a plain transformers model (which has ``set_adapter`` but
    no ``disable_adapter``); every completion used to fail with 500."""
    tok, greedy = reference
    want, _ = greedy("base", encode_messages(tok, MSG), 12)
    with running_server(["--model", str(server["root"] / "base")], api_key=None) as (_, client):
        assert [m.id for m in client.models.list().data] == ["base"]
        _answers_plain_and_streamed(client, "base", want)


def test_checkpoint_server_answers_with_adapter_and_base(server, reference):
    """``--checkpoint DIR``: the base comes from the checkpoint's stored config; the adapter is
    served as ``adapter`` next to the base."""
    tok, greedy = reference
    root = server["root"]
    ckpt = root / "ckpt-a"
    if not ckpt.exists():
        shutil.copytree(root / "a", ckpt)
        (ckpt / "lorafuse_config.json").write_text(json.dumps({"model": str(root / "base")}))
    ids = encode_messages(tok, MSG)
    with running_server(["--checkpoint", str(ckpt), "--base-name", "base"]) as (_, client):
        assert [m.id for m in client.models.list().data] == ["base", "adapter"]
        _answers_plain_and_streamed(client, "adapter", greedy("a", ids, 12)[0])
        _answers_plain_and_streamed(client, "base", greedy("base", ids, 12)[0])
