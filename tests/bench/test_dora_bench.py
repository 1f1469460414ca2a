"""`lorafuse bench --use-dora`: stock PEFT DoRA vs the fused DoRA op, end to end on a tiny model."""

from __future__ import annotations

import json

import pytest

from lorafuse import bench
from lorafuse.bench import llm
from lorafuse.commands import main
from lorafuse.testing import single_thread


@pytest.fixture(autouse=True)
def _one_thread():
    yield from single_thread()  # the in-process tiny steps: threads only add barrier stalls


@pytest.mark.slow  # end to end: five bench runs in process
def test_bench_use_dora_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "spawn", llm.run_worker)  # in this process (a fresh one: ~15 s)
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--batch", "1", "--seq", "16", "--steps", "2",
            "--warmup", "0", "--repeats", "1", "--use-dora", "--quant", "nf4",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "DoRA (stock = PEFT's DoRA, lorafuse = fused DoRA)" in table
    assert "lorafuse/stock" in table and "fused DoRA on 14 module(s)" in table
    data = json.loads(out.read_text())
    assert data["spec"]["use_dora"] is True and "roofline" not in data
    for name in ("stock", "lorafuse"):
        assert data[name]["n_steps"] == 2 and data[name]["tokens_per_s"] > 0
    # same seed, weights and batch: the first losses agree (fp32, fused DoRA vs PEFT's)
    assert abs(data["stock"]["first_loss"] - data["lorafuse"]["first_loss"]) < 1e-4
    assert data["ratio"]["tokens_per_s"] > 0 and data["ratio"]["peak_mem"] > 0
    # QDoRA: the NF4 configurations train DoRA adapters too, fused
    assert "lorafuse-nf4: " in table and table.count("fused DoRA on 14 module(s)") == 3
    assert data["lorafuse-nf4"]["n_steps"] == 2


def test_use_dora_rejects_what_it_does_not_measure(capsys):
    assert main(["bench", "--model", "tiny", "--use-dora", "--method", "dpo"]) == 2
    assert "--use-dora measures eager LLM SFT steps only" in capsys.readouterr().err
