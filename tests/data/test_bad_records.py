"""Bad input stops with file:line and the problem, or is skipped and counted on request."""

from __future__ import annotations

import pytest

from lorafuse.data.formats import DataError, LoadStats, read_examples

GOOD = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize(
    "bad, problem",
    [
        ('{"messages": [', "invalid JSON"),
        (
            {"messages": [{"role": "user"}]},
            r"messages\[0\] must be an object with 'role' and 'content'",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, r"messages\[0\].role='wizard'"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
        ({"messages": "nope"}, "is a string that is not JSON"),
        ({"text": 3}, "field 'messages'"),  # the file's format is messages (fixed by record 1)
    ],
)
def test_error_names_file_line_and_problem(write_jsonl, bad, problem):
    path = write_jsonl("d.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(DataError, match=rf"d.jsonl:2: .*{problem}"):
        read_examples([path])


def test_skip_bad_records_counts(write_jsonl):
    path = write_jsonl("d.jsonl", [GOOD, "not json", {"messages": []}, GOOD])
    stats = LoadStats()
    exs = read_examples([path], skip_bad=True, stats=stats)
    assert len(exs) == 2 and stats.skipped == 2 and stats.records == 2
    assert stats.skipped_examples[0].startswith(f"{path}:2: invalid JSON")


def test_empty_dataset(write_jsonl):
    path = write_jsonl("empty.jsonl", [])
    with pytest.raises(DataError, match="empty dataset"):
        read_examples([path])
    path = write_jsonl("allbad.jsonl", ["{", "{"])
    with pytest.raises(DataError, match="empty dataset"):
        read_examples([path], skip_bad=True)


def test_unknown_format_and_missing_columns(write_jsonl, tmp_path):
    path = write_jsonl("u.jsonl", [{"question": "q", "reply": "r"}])
    with pytest.raises(
        DataError, match=r"u.jsonl:1: unknown record format: keys \['question', 'reply'\]"
    ):
        read_examples([path])
    path = write_jsonl("m.jsonl", [{"instruction": "i", "output": "o"}, {"instruction": "i"}])
    with pytest.raises(DataError, match=r"m.jsonl:2: missing field 'output' \(format alpaca\)"):
        read_examples([path])
    with pytest.raises(DataError, match="no such file"):
        read_examples([str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "x.txt"
    bad.write_text("hi")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        read_examples([str(bad)])
