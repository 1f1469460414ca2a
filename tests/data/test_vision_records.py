"""Vision-language records: both forms give the same tokens, loss on assistant tokens only,
images shrunk to max_pixels, and file:line errors for every bad input."""

from __future__ import annotations

import base64
import io
import json

import pytest

from lorafuse.data.dataset import DataSpec
from lorafuse.data.formats import DataError, read_examples
from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.data.vision import load_image, read_vision_examples, shrink
from lorafuse.data.vision_rows import build_vision, collate, encode_example
from lorafuse.testing.vlm import shape_image, tiny_vlm


@pytest.fixture(scope="module", params=["idefics3", "qwen2_vl"])
def processor(request):
    return tiny_vlm(request.param)[1]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _forms(tmp_path):
    shape_image("red").save(tmp_path / "red.png")
    parts = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "red.png"},
                                     {"type": "text", "text": "colour?"}]},
        {"role": "assistant", "content": "red"}]}  # fmt: skip
    url = {"messages": [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(shape_image("red"))}},
            {"type": "text", "text": "colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]}  # fmt: skip
    column = {"messages": [{"role": "user", "content": "<image>colour?"},
                           {"role": "assistant", "content": "red"}], "images": ["red.png"]}  # fmt: skip
    return _write(tmp_path / "d.jsonl", [parts, url, column])


def test_forms_agree_and_mask_assistant_only(tmp_path, processor):
    spec = DataSpec([_forms(tmp_path)], max_seq_length=512)
    examples = read_vision_examples(spec.train_files)
    rows = [encode_example(ex, processor, spec, 10_000).tensors for ex in examples]
    for row in rows[1:]:
        assert row["input_ids"].tolist() == rows[0]["input_ids"].tolist()
        assert row["labels"].tolist() == rows[0]["labels"].tolist()
    ids, labels = rows[0]["input_ids"][0].tolist(), rows[0]["labels"][0].tolist()
    targets = [t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    text = processor.tokenizer.decode(targets)
    assert text.startswith("red") or text.startswith(" red"), text  # the answer, then end of turn
    assert "colour" not in text
    first_target = next(k for k, lab in enumerate(labels) if lab != IGNORE_INDEX)
    prompt = processor.tokenizer.decode(ids[:first_target])
    assert prompt.rstrip().endswith(("assistant", "Assistant:")), prompt
    batch = collate(rows, processor.tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 3


def test_max_pixels_shrinks_keeping_aspect():
    img = shrink(shape_image(size=(400, 100)), 10_000)
    assert img.size[0] * img.size[1] <= 10_000 and abs(img.size[0] / img.size[1] - 4) < 0.1
    assert shrink(shape_image(size=(40, 10)), 10_000).size == (40, 10)


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"messages": [{"role": "user", "content": "<image><image>hi"},
                       {"role": "assistant", "content": "x"}], "images": ["a.png"]},
         "2 <image> placeholder\\(s\\) but 1 image"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]},
                       {"role": "assistant", "content": "x"}]}, "image 0: image file .*nope.png does not exist"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": "bad.png"}]},
                       {"role": "assistant", "content": "x"}]}, "bad.png is not a readable image"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]},
                       {"role": "assistant", "content": "x"}]}, "remote image URL .* refused"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]},
                       {"role": "assistant", "content": "x"}]}, "content\\[0\\] must be"),
    ],
    ids=["count", "missing", "unreadable", "remote", "bad-part"],
)  # fmt: skip
def test_bad_records_name_file_and_line(tmp_path, record, problem):
    shape_image().save(tmp_path / "a.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    ok = {"messages": [{"role": "user", "content": "<image>hi"},
                       {"role": "assistant", "content": "x"}], "images": ["a.png"]}  # fmt: skip
    path = _write(tmp_path / "d.jsonl", [ok, record])
    processor = tiny_vlm("qwen2_vl")[1]
    with pytest.raises(DataError, match=f"d.jsonl:2: .*{problem}"):
        build_vision(DataSpec([path]), processor, 10_000)


def test_image_in_text_only_data(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"messages": [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}]},
        {"role": "assistant", "content": "x"}]}])  # fmt: skip
    with pytest.raises(DataError, match="d.jsonl:1: record has images, but the model is text-only"):
        read_examples([path])


def test_too_long_never_cuts_an_image(tmp_path):
    shape_image().save(tmp_path / "a.png")
    rec = {"messages": [{"role": "user", "content": "<image>hi"},
                        {"role": "assistant", "content": "x " * 50}], "images": ["a.png"]}  # fmt: skip
    path = _write(tmp_path / "d.jsonl", [rec])
    processor = tiny_vlm("qwen2_vl")[1]
    prepared = build_vision(DataSpec([path], max_seq_length=40), processor, 10_000)
    assert (
        prepared.stats["truncated"] == 1 and prepared.train[0].tensors["input_ids"].shape[1] == 40
    )
    with pytest.raises(DataError, match="d.jsonl:1: record is .* image tokens up to position"):
        build_vision(DataSpec([path], max_seq_length=8), processor, 10_000)


def test_load_image_allowed_dir(tmp_path):
    shape_image().save(tmp_path / "a.png")
    assert load_image("a.png", tmp_path, allowed_dir=tmp_path).size == (48, 40)
    with pytest.raises(ValueError, match="outside the allowed directory"):
        load_image(str(tmp_path / "a.png"), "/", allowed_dir=tmp_path / "sub")
