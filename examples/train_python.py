"""Fine-tune from Python instead of the CLI: the same TrainConfig, the same engine.

    python examples/train_python.py

Trains the built-in SmolLM2-135M-Instruct on the bundled chat sample for a few steps and prints
the summary; the adapter lands in runs/example/final (a stock PEFT adapter dir).
"""

from __future__ import annotations

import os

from lorafuse.train.config import TrainConfig
from lorafuse.train.engine import train

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    cfg = TrainConfig(
        data=[os.path.join(HERE, "data", "chat_sample.jsonl")],
        output_dir="runs/example",
        max_seq_length=256,
        dtype="float32",
        gradient_checkpointing=False,
        max_steps=5,
        lr=5e-4,
    )
    print(train(cfg))
