"""``lorafuse train-image``: a kohya-style LoRA for Stable Diffusion 1.x/2.x or SDXL.

lorafuse train-image --model ./sd15 --data ./train --output-dir out --max-steps 1000
lorafuse train-image --config sdxl_lora.yaml --network-dim 16      # flags override the file
lorafuse train-image --resume out                                   # the stored config is reused
"""

from __future__ import annotations

import argparse
import json
import sys

from lorafuse.commands._args import add_dataclass_arguments
from lorafuse.image.config import ImageTrainConfig

_EXTRA = ("config", "print_config", "_module", "command", "debug")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.description = (parser.description or "") + (
        ". The LoRA is written to <output-dir>/final/lora.safetensors (kohya format). Settings come "
        "from flags, a --config YAML/JSON file (flags override it), or, with --resume and no "
        "--config, from the checkpoint's stored config."
    )
    parser.add_argument("--config", help="YAML or JSON file with ImageTrainConfig fields")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    add_dataclass_arguments(parser, ImageTrainConfig)


def resolve_config(args: argparse.Namespace) -> ImageTrainConfig:
    """Flags over (config file | resumed checkpoint's config | defaults)."""
    overrides = {k: v for k, v in vars(args).items() if k not in _EXTRA}
    return ImageTrainConfig.resolve(overrides, args.config)


def run(args: argparse.Namespace) -> int:
    from lorafuse.image.trainer import train_image
    from lorafuse.train.loop import TrainingInterrupted

    cfg = resolve_config(args)  # ConfigError / CheckpointError are LorafuseErrors: one line, exit 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
        return 0
    try:
        summary = train_image(cfg)
    except TrainingInterrupted as stop:
        print(f"lorafuse train-image: {stop}", file=sys.stderr)
        return 130
    print(json.dumps(summary))
    return 0
