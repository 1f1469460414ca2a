"""`lorafuse merge`: fold one LoRA adapter into its base model, write a Hugging Face model dir."""

from __future__ import annotations

import argparse

from lorafuse.commands._args import add_model_arguments, spec_from_args
from lorafuse.dtypes import parse_dtype
from lorafuse.errors import LorafuseError
from lorafuse.models.resolve import resolve_hf_dir

STORAGE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapters="one")
    parser.add_argument("-o", "--output", required=True, help="output model directory")
    parser.add_argument(
        "--dtype", choices=STORAGE_DTYPES, default="auto",
        help="storage dtype of the merged weights (auto: each base tensor's own dtype)",
    )  # fmt: skip
    parser.add_argument(
        "--max-shard-size", default="2GB", help="largest output shard (e.g. 2GB, 500MB)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")


def merge_from_args(args: argparse.Namespace, output: str, overwrite: bool) -> str:
    """Resolve --checkpoint/--model/--adapter and run the streaming merge into ``output``."""
    from lorafuse.export.merge import merge_adapter

    spec = spec_from_args(args)
    if len(spec.adapters) != 1:
        raise LorafuseError(
            "merge needs exactly one adapter: --checkpoint DIR or --model M --adapter DIR"
        )
    adapter = next(iter(spec.adapters.values()))
    base_dir = resolve_hf_dir(spec.base)
    merge_adapter(
        base_dir, adapter, output, dtype=parse_dtype(getattr(args, "dtype", None)),
        max_shard_size=getattr(args, "max_shard_size", "2GB"), overwrite=overwrite,
        tokenizer_dir=spec.tokenizer_dir,
    )  # fmt: skip
    return base_dir


def run(args: argparse.Namespace) -> int:
    base_dir = merge_from_args(args, args.output, overwrite=args.force)
    print(f"merged {args.checkpoint or args.adapter} into {base_dir} -> {args.output}")
    return 0
