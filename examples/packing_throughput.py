"""Tokens/s with and without packing on a dataset of mixed lengths (same model, same steps).

    python examples/packing_throughput.py                 # built-in SmolLM2-135M, 6 steps each
    python examples/packing_throughput.py --model DIR --steps 10

Counts only real tokens (padding excluded), so the difference is the compute that packing saves
on padding. Both runs happen in this process, one after the other, on the same data.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile


def mixed_length_chats(path: str, n: int = 200, seed: int = 0) -> None:
    """Chats whose answers range from 2 to ~120 words (lengths vary ~30x)."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            k = int(2 + rng.random() ** 3 * 120)  # many short, a few long: typical chat data
            answer = " ".join(rng.choice(words) for _ in range(k))
            msgs = [
                {"role": "user", "content": f"Say {k} greek letter names."},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="model dir / .gguf (default: built-in SmolLM2-135M)"
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-seq-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from lorafuse.train.config import TrainConfig
    from lorafuse.train.engine import train

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "mixed.jsonl")
        mixed_length_chats(data)
        results = {}
        for packing in (False, True):
            cfg = TrainConfig(model=args.model, data=[data], output_dir=os.path.join(tmp, f"p{packing}"),
                              max_seq_length=args.max_seq_length, batch_size=args.batch_size,
                              max_steps=args.steps, packing=packing, gradient_checkpointing=False,
                              dtype="float32", save_steps=0, progress=False)  # fmt: skip
            results[packing] = train(cfg)
    off, on = results[False], results[True]
    print(f"{'':14}{'tokens/s':>10}{'samples/s':>11}{'tokens':>9}")
    print(
        f"{'no packing':14}{off['tokens_per_s']:>10.1f}{off['samples_per_s']:>11.2f}{off['tokens']:>9}"
    )
    print(f"{'packing':14}{on['tokens_per_s']:>10.1f}{on['samples_per_s']:>11.2f}{on['tokens']:>9}")
    print(f"packing speed-up: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x tokens/s")


if __name__ == "__main__":
    main()
