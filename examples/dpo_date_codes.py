"""DPO on a generated preference set: prefer the correct date code over a wrong one.

    python examples/dpo_date_codes.py                 # the built-in SmolLM2-135M-Instruct
    python examples/dpo_date_codes.py --tiny          # a tiny random Llama (seconds, a smoke run)
    python examples/dpo_date_codes.py --device cuda --steps 60 --batch-size 8

The demo task (:mod:`lorafuse.data.demo_task`): a date in words -> its code ``YYYY-MM-DD``. Each
pair's chosen answer is the right code, the rejected one a plausible mistake (day and month
swapped, the day or the year off by one, the spoken date echoed back). The held-out pairs use
dates that never occur in training. Preference accuracy = the fraction of held-out pairs whose
correct answer gets the higher log-probability, for the base model (adapter disabled) and after
``lorafuse train --method dpo`` (the same engine, from Python).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from datetime import date, timedelta

import torch

from lorafuse.data.demo_task import SYSTEM, date_code, generate, spoken
from lorafuse.train.config import TrainConfig
from lorafuse.train.engine import train


def wrong_code(d: date, rng: random.Random) -> str:
    """A plausible wrong answer for date ``d`` (never the right code)."""
    options = [
        date_code(d + timedelta(days=rng.choice([-1, 1]))),
        f"{d.year + rng.choice([-1, 1]):04d}-{d.month:02d}-{d.day:02d}",
        spoken(d),
    ]
    if d.day <= 12 and d.day != d.month:
        options.append(f"{d.year:04d}-{d.day:02d}-{d.month:02d}")
    return rng.choice(options)


def pairs(records: list[dict], seed: int) -> list[dict]:
    """Demo-task records -> conversational preference records (TRL's format)."""
    rng = random.Random(seed)
    out = []
    for r in records:
        d = date.fromisoformat(r["answer"])
        out.append({
            "prompt": r["messages"],
            "chosen": [{"role": "assistant", "content": r["answer"]}],
            "rejected": [{"role": "assistant", "content": wrong_code(d, rng)}],
        })  # fmt: skip
    assert all(p["prompt"][0]["content"] == SYSTEM for p in out)
    return out


def write_jsonl(path: str, records: list[dict]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


@torch.no_grad()
def preference_accuracy(model, tokenizer, path: str, max_len: int, device) -> tuple[float, float]:
    """``(accuracy, mean margin)`` of log p(chosen) - log p(rejected) over the pairs in ``path``."""
    from lorafuse.data.dataset import DataSpec
    from lorafuse.data.preference import build_pairs
    from lorafuse.train.logprobs import sequence_logps
    from lorafuse.train.preference import collate_pairs

    rows = build_pairs(DataSpec(train_files=[path], max_seq_length=max_len), tokenizer).train
    margins = []
    for i in range(0, len(rows), 8):
        chunk = rows[i : i + 8]
        logps = sequence_logps(model, collate_pairs(chunk, tokenizer.pad_token_id, device))
        margins += (logps[: len(chunk)] - logps[len(chunk) :]).tolist()
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
    p.add_argument("--train-pairs", type=int, default=256)
    p.add_argument("--eval-pairs", type=int, default=50)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2, help="pairs per step")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--out", default="runs/dpo_date_codes")
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="dpo-date-codes-")
    train_recs, eval_recs = generate(n_train=args.train_pairs, n_eval=args.eval_pairs)
    train_file, eval_file = os.path.join(work, "train.jsonl"), os.path.join(work, "eval.jsonl")
    write_jsonl(train_file, pairs(train_recs, seed=1))
    write_jsonl(eval_file, pairs(eval_recs, seed=2))
    model_path = None
    if args.tiny:
        from lorafuse.testing import save_tiny_model

        model_path = os.path.join(work, "tiny")
        save_tiny_model(model_path)
    cfg = TrainConfig(
        model=model_path, data=[train_file], output_dir=args.out, method="dpo", beta=args.beta,
        max_seq_length=128, dtype="float32", device=args.device, batch_size=args.batch_size,
        max_steps=args.steps,
        lr=args.lr, lr_scheduler="constant", warmup_steps=2, gradient_checkpointing=False,
        lora_r=16, lora_alpha=16, save_steps=0, seed=0,
    )  # fmt: skip
    summary = train(cfg)

    from peft import PeftModel

    from lorafuse import FastLanguageModel

    base, tok = FastLanguageModel.from_pretrained(
        model_path, dtype=torch.float32, device=args.device
    )
    tok.pad_token = tok.pad_token or tok.eos_token
    model = PeftModel.from_pretrained(base, summary["adapter"]).eval()
    with model.disable_adapter():
        before = preference_accuracy(model, tok, eval_file, cfg.max_seq_length, args.device)
    after = preference_accuracy(model, tok, eval_file, cfg.max_seq_length, args.device)
    print(f"held-out preference accuracy ({args.eval_pairs} pairs, unseen dates): "
          f"base {before[0]:.0%} (mean log-prob margin {before[1]:+.2f}) -> "
          f"after {args.steps} DPO steps {after[0]:.0%} (margin {after[1]:+.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
