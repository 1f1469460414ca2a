"""The server's OpenAI ``image_url`` parts: data URLs and files under --image-dir answer as the
model does directly; remote URLs, files outside the directory and images sent to a text-only
model are 400s naming the problem."""

from __future__ import annotations

import base64
import io

import pytest
from fastapi.testclient import TestClient

from lorafuse.data.vision_rows import prompt_inputs
from lorafuse.generation import GenerationResult, SamplingParams, stream_generate
from lorafuse.serve.server import create_app
from lorafuse.testing.llm import chat_tokenizer, tiny_llama_config
from lorafuse.testing.vlm import shape_image, tiny_vlm


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    model, processor = tiny_vlm("qwen2_vl", scale=20.0)
    root = tmp_path_factory.mktemp("images")
    shape_image("red").save(root / "red.png")
    app = create_app(model, processor.tokenizer, {"tiny-vl": None}, processor=processor,
                     image_dir=str(root))  # fmt: skip
    with TestClient(app) as client:
        yield model, processor, root, client


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _ask(client, url, model="tiny-vl"):
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "colour?"}]
    body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    return client.post("/v1/chat/completions", json=body)


def _reference(model, processor) -> str:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    ids, extra = prompt_inputs(processor, msgs, [shape_image("red")])
    result = GenerationResult()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    list(stream_generate(model, processor.tokenizer, ids, params, result=result, inputs=extra))
    return result.text


def test_data_url_and_allowed_file_answer_as_the_model(vlm):
    model, processor, root, client = vlm
    want = _reference(model, processor)
    for url in (_data_url(shape_image("red")), str(root / "red.png"), f"file://{root}/red.png"):
        r = _ask(client, url)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want


@pytest.mark.parametrize(
    "url, problem",
    [("https://example.org/cat.png", "remote image URL .* refused"),
     ("/etc/hostname", "outside the allowed directory"),
     ("data:image/png;base64,AAAA", "not a readable image")],
    ids=["remote", "outside", "corrupt"],
)  # fmt: skip
def test_bad_images_are_400(vlm, url, problem):
    r = _ask(vlm[3], url)
    assert r.status_code == 400
    assert __import__("re").search(problem, r.json()["error"]["message"]), r.text


def test_text_only_model_refuses_images():
    from transformers import LlamaForCausalLM

    tok = chat_tokenizer()
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tok))).eval()
    with TestClient(create_app(model, tok, {"tiny": None})) as client:
        r = _ask(client, _data_url(shape_image()), model="tiny")
    assert r.status_code == 400 and "text-only" in r.json()["error"]["message"]
