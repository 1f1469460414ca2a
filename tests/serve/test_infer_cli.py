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


def test_dtype_flag_chooses_the_compute_dtype(tiny_ws, tmp_path, monkeypatch):
    """``--dtype`` overrides the loader's choice: on a native-bf16 CPU ``auto`` runs bf16, and a
    user who wants fp32 must be able to say so (chat, infer, eval and serve had no way)."""
    import torch

    import lorafuse.commands.infer as infer_cmd

    seen = []

    def load_and_record(spec, dtype=None):
        loaded = real_load(spec, dtype=dtype)
        seen.append(next(loaded.model.parameters()).dtype)
        return loaded

    real_load = infer_cmd.load_resolved
    monkeypatch.setattr(infer_cmd, "load_resolved", load_and_record)
    monkeypatch.setenv("LORAFUSE_CPU_LOW_PRECISION", "native")  # auto -> bf16 on any CPU
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hello"}\n')
    for flag, want in (("auto", torch.bfloat16), ("fp32", torch.float32), ("bf16", torch.bfloat16)):
        assert _run(tiny_ws, inp, tmp_path / f"{flag}.jsonl", "--dtype", flag) == 0
        assert seen[-1] == want, flag


def test_disk_full_keeps_whole_batches_and_resumes(tiny_ws, tmp_path, monkeypatch, capsys):
    """The second batch's append fills the disk half-way: it is cut off again (no torn line),
    one line says how far it got; the rerun finishes the file as an undisturbed run writes it."""
    from lorafuse import batch_infer
    from lorafuse.testing import filling_open

    recs = [{"prompt": p} for p in ("hello", "The quick brown fox", "answer", "0123", "world")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out, appends = tmp_path / "out.jsonl", []

    def fails(path, mode):
        appends.append(mode)
        return mode == "ab" and len(appends) == 2

    monkeypatch.setattr(batch_infer, "open", filling_open(open, fails), raising=False)
    assert _run(tiny_ws, inp, out, "--batch-size", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        f"lorafuse infer: error: disk full writing completions to {out}: needs about"
    )
    assert "2 of 5 records are in it; free space and rerun the same command" in err
    assert [r["index"] for r in _rows(out)] == [0, 1] and out.read_text().endswith("\n")
    monkeypatch.undo()
    assert _run(tiny_ws, inp, out, "--batch-size", "2") == 0
    assert _run(tiny_ws, inp, tmp_path / "clean.jsonl", "--batch-size", "2") == 0
    assert _rows(out) == _rows(tmp_path / "clean.jsonl")
