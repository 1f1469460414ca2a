"""`lorafuse bench`: the CLI runs end to end on a tiny model and writes a sound JSON result."""

from __future__ import annotations

import json

import pytest

from lorafuse import bench
from lorafuse.cli import main


def test_memory_probe_sees_an_allocation_after_start():
    import torch

    probe = bench.MemoryProbe(torch.device("cpu"))
    probe.start()
    before = probe.peak_bytes()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = probe.peak_bytes()
    del block
    assert after - before >= 60 * 2**20, (before, after)


def test_bad_arguments_are_user_errors(capsys):
    assert main(["bench", "--model", "tiny", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--batch", "1", "--seq", "16", "--steps", "2",
            "--repeats", "1", "--threads", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "lorafuse/stock" in table and "patched 14 of 14 LoRA modules" in table
    data = json.loads(out.read_text())
    for name in ("stock", "lorafuse"):
        assert data[name]["n_steps"] == 2 and data[name]["tokens_per_s"] > 0
    # same seed, same weights, same batch: the first losses agree (fp32, fused vs stock loss)
    assert abs(data["stock"]["first_loss"] - data["lorafuse"]["first_loss"]) < 1e-4
    assert data["ratio"]["tokens_per_s"] > 0
