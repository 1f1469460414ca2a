"""The VLM bench's worker: stock and lorafuse train the same model on the same batches (equal
first losses), and the table prints both sides with their ratio."""

from __future__ import annotations

from lorafuse.bench import vision

SPEC = {"vlm": "qwen2_vl", "size": "tiny", "dtype": "fp32", "device": "cpu", "batch": 2,
        "steps": 1, "warmup": 0, "rank": 4, "grad_ckpt": False, "threads": None,
        "image_px": 48, "finetune_vision": True}  # fmt: skip


def test_worker_sides_agree_and_table():
    out = {c: vision.run_worker({**SPEC, "config": c}) for c in vision.CONFIGS}
    stock, ours = out["stock"]["losses"][0], out["lorafuse"]["losses"][0]
    assert abs(stock - ours) <= 1e-5 * abs(stock), (stock, ours)  # fp32, same init (B = 0)
    assert "patched" in out["lorafuse"]["report"]
    results = {c: {"step_time_s": 1.0, "tokens_per_s": 10.0, "peak_mem_mib": 5.0,
                   "first_loss": out[c]["losses"][0]} for c in vision.CONFIGS}  # fmt: skip
    results["ratio"] = {"speedup": 1.0, "memory": 1.0}
    table = vision.format_table(results, {**SPEC, "repeats": 1})
    assert "stock" in table and "lorafuse / stock: 1.00x speed" in table
