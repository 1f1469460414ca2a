"""`lorafuse bench --method rloo`: TRL's RLOOTrainer vs lorafuse's RLOO on a tiny model, both
sides on the same prompts and generating the same number of tokens, the step split into
generation (+ scoring) and update."""

from __future__ import annotations

import json

import pytest

from lorafuse import bench
from lorafuse.bench import llm
from lorafuse.commands import main

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.mark.slow  # TRL's trainer and two generations: ~30 s on a loaded 2-core CPU
def test_bench_rloo_tiny_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "spawn", llm.run_worker)  # in this process: no interpreter start
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--method", "rloo", "--batch", "2", "--seq", "8",
            "--steps", "1", "--warmup", "0", "--repeats", "1", "--num-generations", "2",
            "--completion-length", "4", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "rloo: 2 prompts x 2 completions of 4 tokens; stock = TRL RLOOTrainer" in table
    assert "step = generation + update" in table
    data = json.loads(out.read_text())
    for name in ("stock", "lorafuse"):
        side = data[name]
        assert side["n_steps"] == 1 and 0 < side["gen_time_s"] < side["step_time_s"]
        assert side["update_time_s"] > 0 and side["peak_mem_mib"] > 0
        # 2 prompts x 2 completions x (8 prompt + 4 completion tokens) per step
        assert side["tokens_per_s"] == pytest.approx(48 / side["step_time_s"])
    assert data["ratio"]["gen_time"] > 0 and data["ratio"]["update_time"] > 0
    # the same prompts (in TRL's order: each repeated G times) and every completion full length
    (stock,), (ours,) = data["runs"]["stock"], data["runs"]["lorafuse"]
    assert stock["seen"] == ours["seen"] and ours["seen"][0]["tokens"] == 48
    assert ours["seen"][0]["rows"] == 4
    assert "batches: every run of both sides trained on the same 1 batches (48 tokens a step)" in (
        table
    )
