"""``python -m lorafuse.demo`` (what ``make demo`` runs): teach the built-in model a new skill.

1. load the built-in SmolLM2-135M-Instruct (``FastLanguageModel.from_pretrained()``) with LoRA;
2. measure held-out exact-match accuracy on the demo task (:mod:`lorafuse.data.demo_task`) BEFORE
   training (the LoRA B matrices start at zero, so this is exactly the base model);
3. fine-tune with LoRA on this machine in fp32 (the regular training engine: packing, progress bar,
   checkpoints under ``--output-dir``);
4. measure the same accuracy AFTER and print a before/after table with training tokens/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from lorafuse.data.demo_task import DEMO_DIR

# Chosen by measurement on a 2-core AVX2 CPU (see README): ~3-5 minutes of training.
DEMO_SETTINGS = dict(
    model=None, dtype="float32", max_seq_length=256, lora_r=16, lora_alpha=32,
    gradient_checkpointing=False, packing=True, epochs=1, batch_size=2, grad_accum=1,
    lr=2e-3, lr_scheduler="cosine", warmup_steps=3, max_grad_norm=1.0, seed=3407,
    logging_steps=1, save_steps=0, save_total_limit=1,
)  # fmt: skip


def exact_match(model, tokenizer, records: list[dict], desc: str) -> tuple[float, list[str]]:
    """Greedy held-out exact match (``lorafuse.evaluation``), with the model in inference mode."""
    from lorafuse import FastLanguageModel
    from lorafuse.evaluation.metrics import task_accuracy

    FastLanguageModel.for_inference(model)  # eval mode, KV cache on (training turns it off)
    try:
        result = task_accuracy(model, tokenizer, records, max_new_tokens=12, batch_size=20,
                               desc=desc, keep_predictions=True)  # fmt: skip
    finally:
        FastLanguageModel.for_training(model)
    return result.exact_match, result.predictions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default=os.path.join("runs", "demo"))
    p.add_argument("--train", default=os.path.join(DEMO_DIR, "train.jsonl"))
    p.add_argument("--eval", default=os.path.join(DEMO_DIR, "eval.jsonl"))
    p.add_argument(
        "--max-steps", type=int, default=None, help="cap the training steps (quick runs)"
    )
    p.add_argument(
        "--eval-limit", type=int, default=None, help="evaluate on the first N held-out records"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from lorafuse.evaluation.metrics import read_task
    from lorafuse.train import distributed as dist
    from lorafuse.train.config import TrainConfig
    from lorafuse.train.engine import Trainer

    cfg = TrainConfig(
        **DEMO_SETTINGS, data=[args.train], output_dir=args.output_dir, max_steps=args.max_steps
    )
    records = read_task(args.eval, args.eval_limit)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, dist.setup("none"))
    trainer.setup()  # base model + LoRA (B = 0: outputs identical to the base model)
    before, _ = exact_match(trainer.model, trainer.tokenizer, records, desc="eval before")
    print(f"held-out exact match BEFORE training: {before:.1%}", file=sys.stderr, flush=True)
    summary = trainer.run()
    after, answers = exact_match(trainer.model, trainer.tokenizer, records, desc="eval after")
    total = time.perf_counter() - t0
    print()
    print(
        "lorafuse demo: teach SmolLM2-135M-Instruct 'lorafuse date codes' (July 4, 2023 -> 2023-07-04)"
    )
    print(f"  {'':28}{'before':>10}{'after':>10}")
    print(
        f"  {'held-out exact match':28}{before:>10.1%}{after:>10.1%}   ({len(records)} unseen dates)"
    )
    print(f"  training: {summary['steps']} steps, {summary['tokens']} tokens in {summary['train_time_s']:.0f} s "
          f"= {summary['tokens_per_s']:.0f} tokens/s (fp32, {torch.get_num_threads()} threads), "
          f"final loss {summary['train_loss']:.3f}")  # fmt: skip
    print(
        f"  examples: {records[0]['messages'][-1]['content']!r} -> {answers[0]!r} (expected {records[0]['answer']!r})"
    )
    print(f"  adapter: {summary['adapter']}   total wall time {total:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
