"""``lorafuse train`` on a tiny Qwen2-VL: fused and stock PEFT give the same losses step by step,
and the checkpoint holds the adapter plus a processor stock transformers names."""

from __future__ import annotations

import json

from lorafuse.testing.vlm import save_tiny_vlm, write_shape_data
from lorafuse.train.config import TrainConfig
from lorafuse.train.engine import train


def test_fused_matches_stock_and_saves_processor(tmp_path):
    save_tiny_vlm(tmp_path / "model", "qwen2_vl")
    data = write_shape_data(tmp_path / "data", 8)
    losses = {}
    for fused in (True, False):
        out = tmp_path / f"out_{fused}"
        cfg = TrainConfig(
            model=str(tmp_path / "model"), data=[data], output_dir=str(out), max_steps=3,
            batch_size=2, lr=1e-3, dtype="float32", device="cpu", progress=False, save_steps=0,
            gradient_checkpointing=fused, fused=fused, max_pixels=2048,
        )  # fmt: skip
        summary = train(cfg)
        lines = (out / "logging.jsonl").read_text().splitlines()
        losses[fused] = [json.loads(x)["loss"] for x in lines if '"loss"' in x]
        assert summary["steps"] == 3
    assert len(losses[True]) == 3
    for a, b in zip(losses[True], losses[False]):  # fp32; Adam amplifies ulps over 3 steps
        assert abs(a - b) <= 1e-4 + 1e-5 * abs(b), (losses[True], losses[False])
    final = tmp_path / "out_True" / "final"
    assert json.loads((final / "processor_config.json").read_text())["processor_class"] == (
        "Qwen2VLProcessor"
    )
    assert (final / "adapter_model.safetensors").is_file()
