"""Record formats: detection, normalisation, every file type."""

from __future__ import annotations

import json

import pytest

from lorafuse.data.formats import DataError, detect_format, normalize, read_examples

CHAT = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                     {"role": "assistant", "content": "a"}]}  # fmt: skip


@pytest.mark.parametrize(
    "record, fmt",
    [
        (CHAT, "messages"),
        (
            {"conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]},
            "sharegpt",
        ),
        ({"instruction": "i", "input": "x", "output": "o"}, "alpaca"),
        ({"prompt": "p", "completion": "c"}, "prompt_completion"),
        ({"text": "t"}, "text"),
    ],
)
def test_detect_format(record, fmt):
    assert detect_format(record) == fmt


def test_unknown_format_names_the_keys():
    with pytest.raises(ValueError, match=r"unknown record format: keys \['foo'\]"):
        detect_format({"foo": 1})


def test_normalise_to_messages():
    ex = normalize({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"},
                                      {"from": "gpt", "value": "a"}]}, "sharegpt", "f:1")  # fmt: skip
    assert ex.messages == CHAT["messages"]
    ex = normalize({"instruction": "do", "input": "this", "output": "done"}, "alpaca", "f:1")
    assert ex.messages == [
        {"role": "user", "content": "do\n\nthis"},
        {"role": "assistant", "content": "done"},
    ]
    ex = normalize({"instruction": "do", "output": "done"}, "alpaca", "f:1")  # input is optional
    assert ex.messages[0]["content"] == "do"
    # eval-task records ({"messages", "answer"}): the answer becomes the assistant turn
    ex = normalize({"messages": CHAT["messages"][:2], "answer": "42"}, "messages", "f:1")
    assert ex.messages[-1] == {"role": "assistant", "content": "42"}
    ex = normalize({"prompt": "p", "completion": "c"}, "prompt_completion", "f:1")
    assert (ex.messages, ex.prompt, ex.completion) == (None, "p", "c")
    ex = normalize({"text": "t"}, "text", "f:1")
    assert (ex.prompt, ex.completion) == ("", "t")


def test_several_files_and_types(tmp_path, write_jsonl):
    import pandas as pd

    a = write_jsonl("a.jsonl", [CHAT, CHAT])
    b = tmp_path / "b.json"
    b.write_text(json.dumps([{"prompt": "p", "completion": "c"}]))
    c = tmp_path / "c.csv"
    pd.DataFrame([{"instruction": "i", "input": "", "output": "o"}] * 3).to_csv(c, index=False)
    d = tmp_path / "d.parquet"
    pd.DataFrame([{"text": "hello"}, {"text": "world"}]).to_parquet(d)
    exs = read_examples([a, str(b), str(c), str(d)])
    assert len(exs) == 2 + 1 + 3 + 2
    assert [e.source for e in exs][:3] == [f"{a}:1", f"{a}:2", f"{b}:1"]
    assert exs[3].source == f"{c}:2"  # CSV line 1 is the header
    assert exs[3].messages[0]["content"] == "i"  # empty CSV input cell = no input
    assert exs[-1].completion == "world"


def test_named_format_is_enforced(write_jsonl):
    path = write_jsonl("t.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match=r"t.jsonl:1: missing field 'prompt'"):
        read_examples([path], "prompt_completion")
