"""`lorafuse infer`: JSONL of prompts in, JSONL of completions out; batched, resumable.

The records, the output format and the resume rule are :mod:`lorafuse.batch_infer`'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lorafuse.batch_infer import done_indices, infer_records, read_records
from lorafuse.commands._args import (
    add_decode_argument,
    add_model_arguments,
    add_sampling_arguments,
    dtype_from_args,
    engine_from_args,
    sampling_from_args,
    spec_from_args,
)
from lorafuse.errors import LorafuseError
from lorafuse.models.resolve import load_resolved


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapters="one", compute_dtype=True)
    add_sampling_arguments(parser)
    add_decode_argument(parser)
    parser.add_argument(
        "--input", required=True, help="JSONL: {'prompt': str} or {'messages': [...]} per line"
    )
    parser.add_argument("--output", required=True, help="JSONL written/appended (resumable)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--raw", action="store_true", help="feed 'prompt' as raw text, no chat template"
    )


def run(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    if args.batch_size < 1:
        raise LorafuseError("--batch-size must be >= 1")
    records = read_records(args.input)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_indices(out)
    todo = [i for i in range(len(records)) if i not in done]
    if not todo:
        print(f"all {len(records)} records already in {out}")
        return 0
    model, tokenizer, processor = load_resolved(spec_from_args(args), dtype=dtype_from_args(args))
    engine = None if processor is not None else engine_from_args(model, args)
    n = infer_records(model, tokenizer, records, todo, out, params, args.input,
                      processor=processor, raw=args.raw, batch_size=args.batch_size,
                      engine=engine)  # fmt: skip
    already = "" if processor is not None else f" ({len(done)} were already there)"
    print(f"wrote {n} completions to {out}{already}")
    return 0
