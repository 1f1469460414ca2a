"""What ``load_in_int8`` costs in quality: the demo task trained twice from the same seed, bf16
base vs int8 base (``lorafuse.models.int8``: the frozen products in int8), everything else equal.

Reports the training loss at fixed steps of both runs and their mean absolute difference over
every step, and the held-out exact match on the demo's unseen dates (``src/lorafuse/data/demo/
eval.jsonl``, greedy) before and after training. Nothing here is timed.

    python benchmarks/int8_quality.py [--steps 200] [--eval-limit 100] [--threads 1]
        [--json out.json]

The demo's settings (``lorafuse.demo.DEMO_SETTINGS``: SmolLM2-135M-Instruct, r=16 on every
linear layer, packing into rows of 256, 2 rows a step, lr 2e-3 cosine) in bf16, for ``--steps``
steps (the demo's 400 examples repeat as epochs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from lorafuse.data.demo_task import DEMO_DIR
from lorafuse.demo import DEMO_SETTINGS, exact_match
from lorafuse.evaluation.metrics import read_task
from lorafuse.files import write_json


def train_one(int8: bool, steps: int, records: list[dict], out_dir: str) -> dict:
    """Train the demo with ``load_in_int8=int8``; per-step losses and exact match after."""
    from lorafuse.train import distributed as dist
    from lorafuse.train.config import TrainConfig
    from lorafuse.train.engine import Trainer

    settings = {**DEMO_SETTINGS, "dtype": "bfloat16", "max_steps": steps, "epochs": 1000}
    cfg = TrainConfig(**settings, data=[os.path.join(DEMO_DIR, "train.jsonl")],
                      output_dir=out_dir, load_in_int8=int8, progress=False)  # fmt: skip
    trainer = Trainer(cfg, dist.setup("none"))
    trainer.setup()
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    after, answers = exact_match(trainer.model, trainer.tokenizer, records, desc="eval")
    return {"losses": losses, "exact_match": after, "answers": answers[:5]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-limit", type=int, default=100)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    records = read_task(os.path.join(DEMO_DIR, "eval.jsonl"), args.eval_limit)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="int8-quality-") as tmp:
        for name, int8 in (("bf16", False), ("int8", True)):
            runs[name] = train_one(int8, args.steps, records, os.path.join(tmp, name))
    a, b = runs["bf16"]["losses"], runs["int8"]["losses"]
    marks = sorted({0, 9, 49, 99, 149, args.steps - 1} & set(range(args.steps)))
    print(f"demo task, bf16 vs int8 frozen products, {args.steps} steps, same seed and batches")
    print("step   " + "  ".join(f"{s + 1:>6d}" for s in marks))
    for name, losses in (("bf16", a), ("int8", b)):
        print(f"{name:6s} " + "  ".join(f"{losses[s]:6.3f}" for s in marks))
    diff = statistics.mean(abs(x - y) for x, y in zip(a, b))
    late = statistics.mean(abs(x - y) for x, y in zip(a[-50:], b[-50:]))
    print(f"mean |loss difference|: {diff:.4f} over all steps, {late:.4f} over the last 50")
    for name in runs:
        print(f"held-out exact match ({len(records)} unseen dates), {name}: "
              f"{runs[name]['exact_match']:.1%}; e.g. {runs[name]['answers'][:2]}")  # fmt: skip
    if args.json:
        write_json(args.json, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
