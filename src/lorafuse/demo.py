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
import json
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


def load_eval(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@torch.no_grad()
def exact_match(model, tokenizer, records: list[dict], *, batch_size: int = 20, max_new_tokens: int = 12,
                desc: str = "eval") -> tuple[float, list[str]]:  # fmt: skip
    """Greedy answers for ``records`` (interface D); returns (accuracy, answers)."""
    from tqdm.auto import tqdm

    from lorafuse import FastLanguageModel

    was_training = model.training
    FastLanguageModel.for_inference(model)  # eval mode, KV cache on (training turns it off)
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues from the right end of every row
    device = next(model.parameters()).device
    answers: list[str] = []
    try:
        for i in tqdm(range(0, len(records), batch_size), desc=desc, file=sys.stderr, leave=False):
            chunk = records[i : i + batch_size]
            prompts = [
                tokenizer.apply_chat_template(
                    r["messages"], tokenize=False, add_generation_prompt=True
                )
                for r in chunk
            ]
            enc = tokenizer(
                prompts, return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, use_cache=True)  # fmt: skip
            new = out[:, enc["input_ids"].shape[1] :]  # (B, generated)
            answers += [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = old_side
        if was_training:
            FastLanguageModel.for_training(model)
    correct = sum(a == r["answer"] for a, r in zip(answers, records))
    return correct / max(1, len(records)), answers


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

    from lorafuse.train import distributed as dist
    from lorafuse.train.config import TrainConfig
    from lorafuse.train.engine import Trainer

    cfg = TrainConfig(
        **DEMO_SETTINGS, data=[args.train], output_dir=args.output_dir, max_steps=args.max_steps
    )
    records = load_eval(args.eval)[: args.eval_limit]
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
