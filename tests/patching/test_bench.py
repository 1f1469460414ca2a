"""`lorafuse bench`: the CLI runs end to end on a tiny model and writes a sound JSON result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lorafuse.commands import main

PROBE_SCRIPT = """
import torch
from lorafuse import bench
probe = bench.MemoryProbe(torch.device("cpu"))
probe.start()
before = probe.peak_bytes()
block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
after = probe.peak_bytes()
print(before, after)
"""


def test_memory_probe_sees_an_allocation_after_start():
    # A fresh process, as `lorafuse bench` uses the probe: inside a long pytest process the
    # allocator may hand back pages that are already resident, which RSS cannot see.
    out = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT], capture_output=True, text=True, check=True
    ).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert after - before >= 250 * 2**20, (before, after)


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
