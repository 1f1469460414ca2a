"""`lorafuse bench --method rm`: TRL's RewardTrainer on a PEFT sequence classifier vs lorafuse's
reward model on a tiny model: both sides train on the same pairs (same token ids every step, same
first loss in fp32), and the table and JSON carry the row's fields."""

from __future__ import annotations

import json

import pytest

from lorafuse import bench
from lorafuse.bench import llm
from lorafuse.bench.report import batches_line
from lorafuse.commands import main

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.mark.slow  # TRL's RewardTrainer and two tiny models: ~25 s on a loaded 2-core CPU
def test_bench_rm_tiny_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "spawn", llm.run_worker)  # in this process: no interpreter start
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--method", "rm", "--batch", "2", "--seq", "8",
            "--steps", "1", "--warmup", "0", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "rm: 2 pairs, chosen + rejected = 4 rows; stock = TRL RewardTrainer" in table
    assert "lorafuse/stock" in table
    data = json.loads(out.read_text())
    for name in ("stock", "lorafuse"):
        side = data[name]
        assert side["n_steps"] == 1 and side["peak_mem_mib"] > 0
        # 2 pairs x (chosen + rejected) x 8 tokens per step
        assert side["tokens_per_s"] == pytest.approx(32 / side["step_time_s"])
    assert data["ratio"]["tokens_per_s"] > 0 and data["ratio"]["peak_mem"] > 0
    # same decoder, same head weights, same pairs: the Bradley-Terry losses agree in fp32
    assert data["stock"]["first_loss"] == pytest.approx(data["lorafuse"]["first_loss"], abs=1e-5)
    (stock,), (ours,) = data["runs"]["stock"], data["runs"]["lorafuse"]
    assert stock["seen"] == ours["seen"] and ours["seen"][0]["tokens"] == 32
    assert ours["seen"][0]["rows"] == 4
    assert "batches: every run of both sides trained on the same 1 batches (32 tokens a step)" in (
        table
    )


def _runs(stock_seen, ours_seen):
    return {"stock": [{"seen": s} for s in stock_seen],
            "lorafuse": [{"seen": s} for s in ours_seen]}  # fmt: skip


def test_batches_line_flags_different_batches():
    a, b = {"tokens": 32, "rows": 4, "digest": "aa"}, {"tokens": 32, "rows": 4, "digest": "bb"}
    line = batches_line(_runs([[a, b], [a, b]], [[a, b], [a, b]]))
    assert (
        line == "batches: every run of both sides trained on the same 2 batches (32 tokens a step)"
    )
    assert "WARNING" in batches_line(_runs([[a, b]], [[a, a]]))  # another batch at step 2
    assert "WARNING" in batches_line(_runs([[a], [a]], [[a], [b]]))  # a later repeat differs
    assert batches_line(_runs([[a]], [])) is None  # --only: nothing to compare
    assert batches_line({"stock": [{}], "lorafuse": [{}]}) is None  # sft / dpo record nothing
