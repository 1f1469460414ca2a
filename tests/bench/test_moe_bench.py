"""`lorafuse bench` on a mixture-of-experts shape: stock PEFT and lorafuse train the same expert,
router and attention LoRA (same first loss), the lorafuse side runs the fused expert op, and the
QLoRA row holds the experts in NF4."""

from __future__ import annotations

import json

import pytest

from lorafuse.bench.config import model_config
from lorafuse.commands import main


@pytest.mark.slow  # four worker processes (stock, lorafuse, two NF4 rows)
def test_bench_moe_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "qwen3-moe-tiny", "--batch", "1", "--seq", "16", "--steps", "1",
            "--warmup", "0", "--repeats", "1", "--threads", "1", "--quant", "nf4",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "moe.experts[moe_lora]: 2 module(s)" in table
    assert "expert LoRA: 4 of 4 routed expert tensors, 2 of 2 routers" in table
    data = json.loads(out.read_text())
    assert "roofline" not in data  # a dense Llama step's products: not computed for MoE shapes
    # same seed, weights, batch and LoRA set: the first losses agree (fp32)
    assert data["stock"]["first_loss"] == pytest.approx(data["lorafuse"]["first_loss"], abs=1e-4)
    # the QLoRA row: each expert stack (E, out, in) fp32 -> NF4, every expert on its own
    cfg = model_config("qwen3-moe-tiny")
    per_expert = 2 * cfg.moe_intermediate_size * cfg.hidden_size  # gate_up; down is half
    nf4 = data["lorafuse-nf4"]
    assert nf4["weights_mib"] < data["lorafuse"]["weights_mib"]
    experts_fp32 = 1.5 * per_expert * 4 * cfg.num_experts * cfg.num_hidden_layers
    assert (data["lorafuse"]["weights_mib"] - nf4["weights_mib"]) * 2**20 > 0.7 * experts_fp32
    assert nf4["first_loss"] == pytest.approx(data["lorafuse"]["first_loss"], rel=0.05)
