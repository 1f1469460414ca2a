"""The demo task: "lorafuse date codes", a skill the base model lacks, checkable exactly.

The user gives a date in words (``"July 4, 2023"``); the assistant must answer with its date code
and nothing else: ``"2023-07-04"``. The code format is never described in the prompt, so the base
model cannot know it (it answers with prose); it has to be learned from the examples: the month
name to a two-digit number, the zero-padded day, the order. Answers are 10 characters, so exact
match is a clean, strict metric.

``python -m lorafuse.data.demo_task`` regenerates ``src/lorafuse/data/demo/{train,eval}.jsonl``
deterministically (seeded); every record is in the eval-task format of ``lorafuse eval --task``::

    {"messages": [{"role": "system", ...}, {"role": "user", ...}], "answer": "2023-07-04"}

The eval dates never occur in the training split.
"""

from __future__ import annotations

import argparse
import calendar
import os
import random
from datetime import date

from lorafuse import files

SYSTEM = "Reply with the lorafuse date code only."
TRAIN_SIZE = 400
EVAL_SIZE = 100
SEED = 20240611
YEARS = (1950, 2049)
DEMO_DIR = os.path.join(os.path.dirname(__file__), "demo")


def date_code(d: date) -> str:
    """The expected answer: ``YYYY-MM-DD``."""
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d}"


def spoken(d: date) -> str:
    """The prompt form: ``"July 4, 2023"``."""
    return f"{calendar.month_name[d.month]} {d.day}, {d.year}"


def record(d: date) -> dict:
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": spoken(d)}],
        "answer": date_code(d),
    }


def generate(
    seed: int = SEED, n_train: int = TRAIN_SIZE, n_eval: int = EVAL_SIZE
) -> tuple[list[dict], list[dict]]:
    """``(train, eval)`` records of distinct random dates (the eval dates are held out)."""
    rng = random.Random(seed)
    start, end = date(YEARS[0], 1, 1).toordinal(), date(YEARS[1], 12, 31).toordinal()
    seen: set[int] = set()
    days: list[date] = []
    while len(days) < n_train + n_eval:
        o = rng.randint(start, end)
        if o not in seen:
            seen.add(o)
            days.append(date.fromordinal(o))
    return [record(d) for d in days[:n_train]], [record(d) for d in days[n_train:]]


def write_jsonl(path: str, records: list[dict]) -> None:
    """Atomic write, one JSON object per line."""
    files.write_jsonl(path, records)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEMO_DIR, help="directory for train.jsonl and eval.jsonl")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--train-size", type=int, default=TRAIN_SIZE)
    p.add_argument("--eval-size", type=int, default=EVAL_SIZE)
    args = p.parse_args(argv)
    train, held_out = generate(args.seed, args.train_size, args.eval_size)
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "eval.jsonl"), held_out)
    print(f"wrote {len(train)} train and {len(held_out)} eval records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
