"""GRPO prompt records: text or messages prompts, the other fields as reward columns, the prompt
budget (max_seq_length - max_completion_length) and file:line errors."""

from __future__ import annotations

import json

import pytest

from lorafuse.data.dataset import DataSpec
from lorafuse.data.formats import DataError
from lorafuse.data.grpo import build_prompts, columns_of, encode_prompt_ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from lorafuse.testing import save_tiny_model

    _, tok = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    return tok


def _write(tmp_path, records) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_text_and_chat_prompts_with_columns(tok, tmp_path):
    chat = [{"role": "user", "content": "what is 2 and 3"}]
    path = _write(tmp_path, [{"prompt": "2+3=", "answer": "5"},
                             {"messages": chat, "answer": "5", "unit": "kg"},
                             {"prompt": chat, "answer": "5"}])  # fmt: skip
    data = build_prompts(DataSpec([path], max_seq_length=64, seed=0), tok, 16)
    assert len(data.train) == 3
    by_prompt = {json.dumps(r.prompt): r for r in data.train}
    text = by_prompt[json.dumps("2+3=")]
    assert text.prompt_ids == list(tok("2+3=")["input_ids"])
    row = next(r for r in data.train if "unit" in r.columns)
    assert row.prompt == chat and row.prompt_ids == encode_prompt_ids(tok, chat)
    assert row.prompt_ids[-3:] != text.prompt_ids[-3:]  # the template's generation prompt
    cols = columns_of(data.train, 2)
    assert cols["answer"] == ["5"] * 6 and cols["unit"].count("kg") == 2 and None in cols["unit"]


@pytest.mark.parametrize(
    "record, match",
    [
        ({"answer": "5"}, "exactly one of 'prompt'"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
         "assistant's"),
        ({"prompt": "  "}, "empty prompt"),
        ({"prompt": 5}, "must be a string or a messages list"),
    ],
)  # fmt: skip
def test_bad_records_name_file_and_line(tok, tmp_path, record, match):
    path = _write(tmp_path, [{"prompt": "fine"}, record])
    with pytest.raises(DataError, match=match) as err:
        build_prompts(DataSpec([path], max_seq_length=64), tok, 16)
    assert f"{path}:2:" in str(err.value)


def test_too_long_prompts(tok, tmp_path):
    long = "word " * 60
    path = _write(tmp_path, [{"prompt": long}, {"prompt": "short"}])
    spec = lambda mode: DataSpec([path], max_seq_length=48, too_long=mode)  # noqa: E731
    kept = build_prompts(spec("truncate"), tok, 16)
    assert max(len(r.prompt_ids) for r in kept.train) == 32 and kept.stats["truncated"] == 1
    full = encode_prompt_ids(tok, long)
    cut = next(r for r in kept.train if len(r.prompt_ids) == 32)
    assert cut.prompt_ids == full[-32:]  # the end of the prompt is kept
    dropped = build_prompts(spec("drop"), tok, 16)
    assert len(dropped.train) == 1 and dropped.stats["dropped_too_long"] == 1
    with pytest.raises(DataError, match=r"p.jsonl:1: prompt is \d+ tokens"):
        build_prompts(spec("error"), tok, 16)
    with pytest.raises(DataError, match="no room"):
        build_prompts(DataSpec([path], max_seq_length=16), tok, 16)
