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


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_utf8_byte_order_mark_is_accepted(tmp_path, suffix):
    """Windows editors write a BOM; the first record must still parse (it did not, for JSONL)."""
    import json

    path = tmp_path / f"bom{suffix}"
    if suffix == ".jsonl":
        text = "\n".join(json.dumps(r) for r in (GOOD, GOOD))
    elif suffix == ".json":
        text = json.dumps([GOOD, GOOD])
    else:
        text = "prompt,completion\nq1,a1\nq2,a2\n"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert len(read_examples([str(path)])) == 2


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_non_utf8_file_names_file_line_and_byte(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    body = {".jsonl": '{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n',
            ".json": '[\n{"prompt": "a", "completion": "b"},\n{"prompt": "caf\xe9", "completion": "b"}\n]',
            ".csv": "prompt,completion\na,b\ncaf\xe9,b\n"}[suffix]  # fmt: skip
    path.write_bytes(body.encode("latin-1"))
    line = 3 if suffix != ".jsonl" else 2
    with pytest.raises(DataError, match=rf"latin1{suffix}:{line}: not UTF-8 text \(byte 0xe9"):
        read_examples([str(path)])


def test_jsonl_objects_accepts_bom_and_rejects_bad_encoding(tmp_path):
    from lorafuse.data.formats import jsonl_objects

    good = tmp_path / "bom.jsonl"
    good.write_bytes(b'\xef\xbb\xbf{"prompt": "x"}\n')
    assert list(jsonl_objects(good)) == [(1, {"prompt": "x"})]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "x"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8"):
        list(jsonl_objects(bad))
