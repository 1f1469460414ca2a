"""`lorafuse infer`: batched == one by one, resumable, clear errors on malformed input."""

from __future__ import annotations

import json

from lorafuse.commands import main


def _run(ws, inp, out, *extra):
    return main(["infer", "--checkpoint", str(ws["checkpoint"]), "--input", str(inp),
                 "--output", str(out), "--max-new-tokens", "6", *extra])  # fmt: skip


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batched_matches_unbatched_and_resumes(tiny_ws, tmp_path):
    recs = [{"prompt": "hello"}, {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
            {"prompt": "The quick brown fox", "id": "x"}, {"prompt": "answer"}, {"prompt": "0123"}]  # fmt: skip
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert _run(tiny_ws, inp, tmp_path / "b1.jsonl", "--batch-size", "1") == 0
    assert _run(tiny_ws, inp, tmp_path / "b3.jsonl", "--batch-size", "3") == 0
    one, three = _rows(tmp_path / "b1.jsonl"), _rows(tmp_path / "b3.jsonl")
    assert [r["index"] for r in three] == [0, 1, 2, 3, 4] and three[2]["id"] == "x"
    # left padding + attention mask: batching must not change greedy completions
    assert [r["completion"] for r in one] == [r["completion"] for r in three]
    # resume: keep 2 rows + a torn third line (as after a kill), rerun, get the same file
    lines = (tmp_path / "b3.jsonl").read_text().splitlines(keepends=True)
    partial = tmp_path / "part.jsonl"
    partial.write_text("".join(lines[:2]) + lines[2][:10])
    assert _run(tiny_ws, inp, partial, "--batch-size", "2") == 0
    assert sorted(_rows(partial), key=lambda r: r["index"]) == three
    assert _run(tiny_ws, inp, partial) == 0  # nothing left to do


def test_malformed_input_names_line(tiny_ws, tmp_path, capsys):
    inp = tmp_path / "bad.jsonl"
    inp.write_text('{"prompt": "ok"}\n\n{"prompt": 3}\n')
    assert _run(tiny_ws, inp, tmp_path / "o.jsonl") == 2
    assert "bad.jsonl:3" in capsys.readouterr().err
    inp.write_text('{"prompt": "ok"}\n{not json\n')
    assert _run(tiny_ws, inp, tmp_path / "o.jsonl") == 2
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
