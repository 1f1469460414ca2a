"""A chat reply ends at the chat template's end-of-turn token, in ``lorafuse chat`` and in
``serve``'s chat route, for every family - also where it is not the tokenizer's EOS (Gemma's
``<eos>``, Phi-3's ``<|endoftext|>``, the first Llama 3's ``<|end_of_text|>``, a Qwen2.5 base):
the "never stops" / "prints the template" complaint. Each tiny model is pushed to the
end-of-turn token by ``logit_bias``, so the reply must end at its first token; stopping on EOS
alone would run on to ``max_new_tokens``.
"""

from __future__ import annotations

import io

import pytest

from lorafuse.commands.chat import ChatSession
from lorafuse.generation import SamplingParams, end_of_turn_token, stream_generate
from lorafuse.testing.chat_families import CHAT_FAMILIES, OLDER_ARCHS, save_family_chat_model

FAMILIES = sorted(CHAT_FAMILIES)
DIFFERENT = sorted(n for n, f in CHAT_FAMILIES.items() if f.eos != f.eot)


def test_some_families_end_turns_with_a_token_that_is_not_eos():
    assert {"gemma2", "gemma3", "phi3", "llama3", "qwen2.5-base"} <= set(DIFFERENT)


@pytest.mark.parametrize("name", FAMILIES)
def test_end_of_turn_token_is_found_in_the_template(name, tmp_path):
    from lorafuse.testing.chat_families import save_family_tokenizer

    tok = save_family_tokenizer(name, tmp_path)
    assert end_of_turn_token(tok) == CHAT_FAMILIES[name].eot
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_token(tok) is None  # no special token closes a turn


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_session_stops_at_the_end_of_turn_token(name, tmp_path):
    model, tok = save_family_chat_model(name, tmp_path)
    eot = tok.convert_tokens_to_ids(CHAT_FAMILIES[name].eot)
    params = SamplingParams(max_new_tokens=12, logit_bias={eot: 1e4})
    session = ChatSession(model, tok, params, out=io.StringIO())
    result = session.reply("Name a prime number.")
    assert (result.finish_reason, result.completion_tokens, result.text) == ("stop", 1, "")
    assert session.history[-1] == {"role": "assistant", "content": ""}
    if name in DIFFERENT:  # stopping on EOS alone runs on to max_new_tokens
        ids = tok.apply_chat_template(session.messages()[:1], add_generation_prompt=True)[
            "input_ids"
        ]
        plain = SamplingParams(max_new_tokens=12, logit_bias={eot: 1e4})
        runaway = _result(model, tok, list(ids), plain)
        assert (runaway.finish_reason, runaway.completion_tokens) == ("length", 12)


def _result(model, tok, ids, params):
    from lorafuse.generation import GenerationResult

    result = GenerationResult()
    for _ in stream_generate(model, tok, ids, params, result=result):
        pass
    return result


@pytest.mark.parametrize("name", DIFFERENT)
def test_serve_chat_reply_stops_at_the_end_of_turn_token(name, tmp_path):
    from fastapi.testclient import TestClient

    from lorafuse.serve.server import create_app

    model, tok = save_family_chat_model(name, tmp_path)
    eot = tok.convert_tokens_to_ids(CHAT_FAMILIES[name].eot)
    app = create_app(model, tok, {"tiny": None}, default_max_tokens=12)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "logit_bias": {str(eot): 100}}  # fmt: skip
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["choices"][0]["message"]["content"] == ""
        assert out["usage"]["completion_tokens"] == 1
    app.state.worker.stop()


def test_batched_generation_is_given_the_end_of_turn_token_as_an_eos(tmp_path, monkeypatch):
    """Where ``infer`` and ``eval`` generate through HF ``generate`` (the model's own forward, not
    the decode engine): the end-of-turn id goes into its ``eos_token_id`` list with the EOS, so a
    batched chat reply stops there too."""
    from lorafuse.generation import chat_stop_ids, generate_batch

    model, tok = save_family_chat_model("gemma3", tmp_path)
    seen, real = [], model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: seen.append(kw) or real(**kw))
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    params = SamplingParams(max_new_tokens=3, stop_token_ids=chat_stop_ids(tok))
    generate_batch(model, tok, [list(ids["input_ids"])], params, engine=None)
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    assert seen[0]["eos_token_id"] == sorted({eot, tok.eos_token_id})


# Each family on its own architecture (Qwen2, Qwen3, Gemma 2/3, Phi-3, Mistral, SmolLM3), fitted to
# answer and end its turn: the reply is transformers' greedy one, without any logit_bias (the
# late-2026 families' stops are checked in llama.cpp, tests/export/test_gguf_chat.py)
OWN = sorted(n for n, f in CHAT_FAMILIES.items()
             if f.arch in OLDER_ARCHS and f.arch != "LlamaForCausalLM")  # fmt: skip


@pytest.fixture(scope="module", params=OWN)
def replier(request, tmp_path_factory):
    """(family name, model dir, transformers' greedy reply ids): a ``save_family_replier``."""
    import torch

    from lorafuse.testing.chat_families import QUESTION, save_family_replier

    name = request.param
    path = tmp_path_factory.mktemp(name)
    model, tok = save_family_replier(name, path)
    eot = tok.convert_tokens_to_ids(CHAT_FAMILIES[name].eot)
    prompt = torch.tensor(
        [tok.apply_chat_template([QUESTION], add_generation_prompt=True)["input_ids"]]
    )
    with torch.no_grad():  # transformers' own loop; with the EOS alone it runs past the turn
        want = model.generate(prompt, do_sample=False, max_new_tokens=16, eos_token_id=[eot])
        runaway = model.generate(prompt, do_sample=False, max_new_tokens=16)
    want = want[0, prompt.shape[1] :].tolist()
    assert want[-1] == eot and len(want) < 16
    if name in DIFFERENT:
        assert runaway.shape[1] - prompt.shape[1] == 16
    return name, path, want


def test_family_model_chat_reply_is_transformers_greedy_ending_at_end_of_turn(replier):
    import torch

    from lorafuse.models.resolve import ModelSpec, load_resolved
    from lorafuse.testing.chat_families import QUESTION

    name, path, want = replier
    model, tok, _ = load_resolved(
        ModelSpec(base=str(path)), dtype=torch.float32
    )  # as chat / serve do
    text = tok.decode(want[:-1], skip_special_tokens=True)
    session = ChatSession(model, tok, SamplingParams(max_new_tokens=16), out=io.StringIO())
    result = session.reply(QUESTION["content"])
    assert (result.finish_reason, result.completion_tokens, result.text) == (
        "stop",
        len(want),
        text,
    )


def test_family_model_serve_reply_is_transformers_greedy_ending_at_end_of_turn(replier):
    import torch
    from fastapi.testclient import TestClient

    from lorafuse.models.resolve import ModelSpec, load_resolved
    from lorafuse.serve.server import create_app
    from lorafuse.testing.chat_families import QUESTION

    name, path, want = replier
    model, tok, _ = load_resolved(ModelSpec(base=str(path)), dtype=torch.float32)
    app = create_app(model, tok, {"tiny": None}, default_max_tokens=16)
    body = {"model": "tiny", "messages": [QUESTION], "temperature": 0}
    try:
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json=body)
    finally:
        app.state.worker.stop()
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["message"]["content"] == tok.decode(
        want[:-1], skip_special_tokens=True
    )
    assert out["usage"]["completion_tokens"] == len(want)
