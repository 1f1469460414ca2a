"""`lorafuse chat --image` and `lorafuse infer` with image records on a tiny Qwen2-VL: both
record forms and the chat session answer as generation on the processor's inputs does; images
for a text-only model are clear errors."""

from __future__ import annotations

import io
import json

import pytest
import torch

from lorafuse.commands import main
from lorafuse.commands.chat import ChatSession
from lorafuse.data.vision_rows import prompt_inputs
from lorafuse.generation import GenerationResult, SamplingParams, stream_generate
from lorafuse.models.resolve import load_resolved, resolve_spec
from lorafuse.testing.vlm import save_tiny_vlm, shape_image

QUESTION = "What colour is it?"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    save_tiny_vlm(root / "model", "qwen2_vl", scale=20.0)
    shape_image("blue").save(root / "blue.png")
    return root


def _reference(model_dir, n=5) -> str:
    model, tok, processor = load_resolved(resolve_spec(model=str(model_dir)), dtype=torch.float32)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids, extra = prompt_inputs(processor, msgs, [shape_image("blue")])
    result = GenerationResult()
    list(stream_generate(model, tok, ids, SamplingParams(max_new_tokens=n),
                         result=result, inputs=extra))  # fmt: skip
    return result.text


def test_infer_both_forms_match_generation(vlm_dir, tmp_path):
    parts = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": "blue.png"}, {"type": "text", "text": QUESTION}]}]}  # fmt: skip
    column = {"prompt": f"<image>{QUESTION}", "images": ["blue.png"]}
    inp = vlm_dir / "in.jsonl"
    inp.write_text(json.dumps(parts) + "\n" + json.dumps(column) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["infer", "--model", str(vlm_dir / "model"), "--input", str(inp), "--output", str(out),
            "--max-new-tokens", "5", "--dtype", "fp32"]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = _reference(vlm_dir / "model")
    assert want and [r["completion"] for r in rows] == [want, want]


def test_chat_session_with_image(vlm_dir):
    model, tok, processor = load_resolved(
        resolve_spec(model=str(vlm_dir / "model")), dtype=torch.float32
    )
    params = SamplingParams(max_new_tokens=5)
    out = io.StringIO()
    session = ChatSession(model, tok, params, out=out, processor=processor,
                          images=[str(vlm_dir / "blue.png")])  # fmt: skip
    assert session.reply(QUESTION).text == _reference(vlm_dir / "model")
    assert session.images and not session.pending  # the image belongs to the first turn
    session.handle(f"/image {vlm_dir / 'blue.png'}")
    session.handle("and now?")
    assert len(session.images) == 2 and len(session.history) == 4


def test_images_for_a_text_only_model(tiny_ws, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "<image>hi", "images": ["x.png"]}) + "\n")
    args = ["infer", "--checkpoint", str(tiny_ws["checkpoint"]), "--input", str(inp),
            "--output", str(tmp_path / "o.jsonl")]  # fmt: skip
    assert main(args) == 2
    assert "record 0 has images, but the model is text-only" in capsys.readouterr().err
    assert main(["chat", "--checkpoint", str(tiny_ws["checkpoint"]), "--image", "x.png"]) == 2
    assert "text-only model" in capsys.readouterr().err
