"""`lorafuse serve` end to end: a real server process driven by the official openai client."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import shutil
import time

import httpx
import openai
import pytest
import torch

from lorafuse.generation import encode_messages, encode_prompt
from lorafuse.testing import save_tiny_adapter, save_tiny_model

KEY = "sk-test-123"  # the key conftest.running_server sets
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory, launch_server):
    root = tmp_path_factory.mktemp("serve")
    # long context so the disconnect test can ask for thousands of tokens
    save_tiny_model(root / "base", max_position_embeddings=4096)
    save_tiny_adapter(root / "base", root / "a", seed=1)
    save_tiny_adapter(root / "base", root / "b", seed=2, target_modules=["q_proj", "v_proj"])
    # fp32 whatever the CPU (auto picks bf16 where it is native): logprobs are checked to 1e-5
    args = ["--model", str(root / "base"), "--adapter", f"a={root / 'a'}", "--adapter",
            f"b={root / 'b'}", "--base-name", "base", "--max-body-bytes", "20000",
            "--dtype", "fp32"]  # fmt: skip
    with launch_server(args) as (url, client):
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


def test_base_only_server_answers(server, reference, launch_server):
    """No adapter at all: the model is a plain transformers model (which has ``set_adapter`` but
    no ``disable_adapter``); every completion used to fail with 500."""
    tok, greedy = reference
    want, _ = greedy("base", encode_messages(tok, MSG), 12)
    with launch_server(["--model", str(server["root"] / "base")], api_key=None) as (_, client):
        assert [m.id for m in client.models.list().data] == ["base"]
        _answers_plain_and_streamed(client, "base", want)


def test_checkpoint_server_answers_with_adapter_and_base(server, reference, launch_server):
    """``--checkpoint DIR``: the base comes from the checkpoint's stored config; the adapter is
    served as ``adapter`` next to the base."""
    tok, greedy = reference
    root = server["root"]
    ckpt = root / "ckpt-a"
    if not ckpt.exists():
        shutil.copytree(root / "a", ckpt)
        (ckpt / "lorafuse_config.json").write_text(json.dumps({"model": str(root / "base")}))
    ids = encode_messages(tok, MSG)
    args = ["--checkpoint", str(ckpt), "--base-name", "base", "--dtype", "fp32"]  # as `reference`
    with launch_server(args) as (_, client):
        assert [m.id for m in client.models.list().data] == ["base", "adapter"]
        _answers_plain_and_streamed(client, "adapter", greedy("a", ids, 12)[0])
        _answers_plain_and_streamed(client, "base", greedy("base", ids, 12)[0])


# --- logprobs, echo, n, logit_bias, penalties, refusals -------------------------------------


@pytest.fixture(scope="module")
def forward(server):
    """(tokenizer, f(model_id, ids) -> (T, V) fp32 log-probabilities of one full forward pass)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = server["root"]
    tok = AutoTokenizer.from_pretrained(root / "base")
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, root / "a", adapter_name="a")

    def logp(model_id, ids):
        ctx = model.disable_adapter() if model_id == "base" else contextlib.nullcontext()
        with ctx, torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)

    return tok, logp


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 + 1e-5 * abs(b)  # fp32 (STYLE.md); KV-cached vs one full pass


def test_chat_logprobs_are_the_models_and_stream_the_same(server, forward, reference):
    tok, logp = forward
    client = server["client"]
    kw = dict(model="a", messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    prompt = encode_messages(tok, MSG)
    want, new = reference[1]("a", prompt, 6)
    assert r.choices[0].message.content == want
    # an ending EOS has an entry too (as OpenAI and vLLM list it; lm-eval relies on it)
    lp = logp("a", prompt + new)
    assert len(content) == len(new)
    for t, item in enumerate(content):
        row = lp[len(prompt) - 1 + t]  # the distribution that produced token t
        top = torch.topk(row, 3)
        assert item.token == tok.decode([int(top.indices[0])])  # greedy: the raw argmax
        assert _close(item.logprob, float(top.values[0])) and item.bytes == list(
            item.token.encode()
        )
        assert [x.token for x in item.top_logprobs] == [tok.decode([int(i)]) for i in top.indices]
        assert all(_close(x.logprob, float(v)) for x, v in zip(item.top_logprobs, top.values))
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.content
    ]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]  # fmt: skip


def test_completions_echo_scores_the_prompt_like_lm_eval(server, forward):
    """lm-eval's local-completions: token-id prompts in a batch, echo + logprobs, max_tokens=1."""
    tok, logp = forward
    client = server["client"]
    prompts = [encode_prompt(tok, "The quick brown fox"), encode_prompt(tok, "0123 hello")]
    r = client.completions.create(model="base", prompt=prompts, max_tokens=1, temperature=0,
                                  echo=True, logprobs=1)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    for ids, choice in zip(prompts, r.choices):
        got = choice.logprobs
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        assert len(got.tokens) == len(ids) + 1 and choice.text.startswith(tok.decode(ids))
        lp = logp("base", ids)
        for t in range(1, len(ids)):
            assert _close(got.token_logprobs[t], float(lp[t - 1, ids[t]]))
            top1 = int(lp[t - 1].argmax())
            assert _close(got.top_logprobs[t][tok.decode([top1])], float(lp[t - 1, top1]))
        assert got.text_offset == [
            sum(len(s) for s in got.tokens[:i]) for i in range(len(got.tokens))
        ]
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)
    # streamed: the prompt's chunk first, then the generated token's
    chunks = list(client.completions.create(model="base", prompt=prompts[0], max_tokens=1, temperature=0,
                                            echo=True, logprobs=1, stream=True))  # fmt: skip
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == r.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_echo_edge_cases_lm_eval_sends(server, forward):
    """An EOS as the one generated token still gets its entry (lm-eval drops the last entry);
    max_tokens=0 with echo scores the prompt alone; five stop strings are taken."""
    tok, logp = forward
    client = server["client"]
    ids = encode_prompt(tok, "The quick brown fox")
    eos = tok.eos_token_id
    r = client.completions.create(model="base", prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                  logprobs=1, logit_bias={str(eos): 100})  # fmt: skip
    got = r.choices[0].logprobs
    assert len(got.tokens) == len(ids) + 1 and got.tokens[-1] == tok.decode([eos])
    assert _close(got.token_logprobs[-1], float(logp("base", ids)[-1, eos]))  # raw, pre-bias
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.completions.create(model="base", prompt=[ids], max_tokens=0, echo=True, logprobs=0)
    assert len(r.choices[0].logprobs.tokens) == len(ids) and r.usage.completion_tokens == 0
    assert r.choices[0].text == tok.decode(ids)
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 needs echo"):
        client.completions.create(model="base", prompt="hi", max_tokens=0)
    stops = ["\n", ".", "?", "Q:", "<|im_end|>"]
    r = client.completions.create(
        model="base", prompt="hello", max_tokens=4, temperature=0, stop=stops
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="at most 16 stop"):
        client.completions.create(model="base", prompt="hello", stop=[str(i) for i in range(17)])


def test_tokenizer_routes(server, forward):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer); keyed."""
    tok, _ = forward
    url, auth = server["url"], {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "The quick brown fox", "add_special_tokens": False}
    r = httpx.post(url + "/tokenize", json=body, headers=auth).json()
    assert r["tokens"] == tok("The quick brown fox", add_special_tokens=False)["input_ids"]
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 4096
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, headers=auth).json()
    assert back == {"prompt": "The quick brown fox"}
    info = httpx.get(url + "/tokenizer_info", headers=auth).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert httpx.post(url + "/tokenize", json=body).status_code == 401
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**6]}, headers=auth)
    assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]
    bad = httpx.post(url + "/tokenize", json={**body, "model": "nope"}, headers=auth)
    assert bad.status_code == 404


def test_n_choices_seeded_and_limited(server):
    client = server["client"]
    kw = dict(model="b", messages=MSG, max_tokens=8, temperature=1.0, seed=3, n=3)
    first = [c.message.content for c in client.chat.completions.create(**kw).choices]
    again = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert first == again and len(set(first)) > 1  # reproducible, and the choices differ
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]  # fmt: skip
    assert streamed == first
    with pytest.raises(openai.BadRequestError, match="limit of 8"):
        client.chat.completions.create(**{**kw, "n": 9})


def test_logit_bias_and_penalties_change_the_sampled_tokens(server, forward):
    tok, logp = forward
    client = server["client"]
    forced = tok.convert_tokens_to_ids(tok.tokenize("a")[-1])
    r = client.completions.create(model="base", prompt="hello", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100}, logprobs=0)  # fmt: skip
    assert r.choices[0].logprobs.tokens == [tok.decode([forced])] * 4
    # reported logprobs stay the model's own (before the bias), not ~0
    ids = encode_prompt(tok, "hello")
    assert _close(r.choices[0].logprobs.token_logprobs[0], float(logp("base", ids)[-1, forced]))
    # frequency penalty: greedy on logits minus 2 x count of each generated token
    seq, counts = list(ids), torch.zeros(logp("base", ids).shape[-1])
    for _ in range(8):
        token = int((logp("base", seq)[-1] - 2.0 * counts).argmax())
        seq.append(token)
        counts[token] += 1
    r = client.completions.create(model="base", prompt="hello", max_tokens=8, temperature=0,
                                  frequency_penalty=2.0, logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert [tok.decode([t]) for t in seq[len(ids) :]] == r.choices[0].logprobs.tokens


def test_unimplemented_fields_are_refused_by_name(server):
    url = server["url"] + "/v1/chat/completions"
    hdr = {"Authorization": f"Bearer {KEY}"}
    base = {"model": "base", "messages": MSG, "max_tokens": 2}
    cases = {
        "response_format": {"response_format": {"type": "json_object"}},
        "best_of": {"best_of": 2},
        "messages.0.audio": {"messages": [{**MSG[0], "audio": {"id": "a1"}}]},
        "stream_options.foo": {"stream_options": {"foo": True}},
    }
    for param, extra in cases.items():
        r = httpx.post(url, json={**base, **extra}, headers=hdr)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "unsupported_parameter"
        assert param.split(".")[-1] in err["message"]
    # tools with a template that has no tools support (test_tools.py covers one that has)
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = httpx.post(url, json={**base, "tools": tools}, headers=hdr)
    assert r.status_code == 400 and "no tools support" in r.json()["error"]["message"]
    # null means "not given" (what clients send), and the plain text format is the default
    ok = {**base, "tools": None, "response_format": {"type": "text"}, "user": "u1"}
    assert httpx.post(url, json=ok, headers=hdr).status_code == 200
    r = httpx.post(server["url"] + "/v1/completions", json={"model": "base", "prompt": "x", "suffix": "y"},
                   headers=hdr)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
