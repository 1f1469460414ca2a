"""The demo dataset: deterministic, interface-D records, held-out split, committed files current."""

from __future__ import annotations

import json
import os

from lorafuse.data.demo_task import DEMO_DIR, date_code, generate, main


def test_generate_is_deterministic_and_held_out():
    train, held_out = generate()
    assert (train, held_out) == generate()
    assert len(train) == 400 and len(held_out) == 100
    train_q = {r["messages"][-1]["content"] for r in train}
    assert not train_q & {r["messages"][-1]["content"] for r in held_out}  # unseen dates
    for r in train[:5] + held_out[:5]:
        assert [m["role"] for m in r["messages"]] == ["system", "user"]
        assert len(r["answer"]) == 10 and r["answer"][4] == "-" and r["answer"][7] == "-"


def test_date_code():
    from datetime import date

    assert date_code(date(2023, 7, 4)) == "2023-07-04"


def test_committed_files_match_the_generator(tmp_path):
    assert main(["--out", str(tmp_path)]) == 0
    for name in ("train.jsonl", "eval.jsonl"):
        with open(os.path.join(DEMO_DIR, name)) as a, open(tmp_path / name) as b:
            assert a.read() == b.read(), f"{name} is stale: run python -m lorafuse.data.demo_task"
        with open(tmp_path / name) as f:
            json.loads(f.readline())
