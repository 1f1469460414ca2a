"""`lorafuse bench --method distill`: TRL's DistillationTrainer loss vs lorafuse's on a tiny model
(a second random model as the teacher on both sides): both run, same first loss, a row each."""

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


@pytest.mark.slow  # TRL's trainer and two models per side: ~30 s on a loaded 2-core CPU
def test_bench_distill_tiny_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "spawn", llm.run_worker)  # in this process: no interpreter start
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--method", "distill", "--batch", "2", "--seq", "16",
            "--steps", "1", "--warmup", "1", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "stock = TRL DistillationTrainer loss" in table
    data = json.loads(out.read_text())
    runs = {name: data["runs"][name][0] for name in ("stock", "lorafuse")}
    # step 1: LoRA B = 0 on both sides, so the student is the same base: the same divergence
    first = [runs[name]["losses"][0] for name in ("stock", "lorafuse")]
    assert first[0] > 0 and first[1] == pytest.approx(first[0], rel=1e-5)
    for name in ("stock", "lorafuse"):
        assert data[name]["tokens_per_s"] == pytest.approx(32 / data[name]["step_time_s"])
        assert runs[name]["peak_bytes"] > 0
