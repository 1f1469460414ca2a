"""``lorafuse train``: flags (generated from :class:`TrainConfig`), a config file, or a checkpoint.

lorafuse train --data chats.jsonl --epochs 2 --output-dir out
lorafuse train --config configs/smollm2_lora.yaml --lr 1e-4       # flags override the file
lorafuse train --resume out/checkpoint-200                          # the stored config is reused
lorafuse train --config run.yaml --nproc 2                          # torchrun, 2 processes
"""

from __future__ import annotations

import argparse
import json
import sys

from lorafuse.commands._args import add_dataclass_arguments
from lorafuse.errors import LorafuseError
from lorafuse.train.config import TrainConfig

_EXTRA = ("config", "nproc", "print_config", "_module", "command", "debug")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.description = (parser.description or "") + (
        ". Settings come from flags, a --config YAML/JSON file (flags override it), or, with --resume "
        "and no --config, from the checkpoint's stored config."
    )
    parser.add_argument("--config", help="YAML or JSON file with TrainConfig fields")
    parser.add_argument("--nproc", type=int, help="run on N local processes under torchrun (DDP)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    add_dataclass_arguments(parser, TrainConfig)


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Flags over (config file | resumed checkpoint's config | defaults)."""
    overrides = {k: v for k, v in vars(args).items() if k not in _EXTRA}
    return TrainConfig.resolve(overrides, args.config)


def to_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` flags that produce ``args`` (without --nproc): what each torchrun worker gets."""
    argv = ["--config", args.config] if args.config else []
    return argv + TrainConfig.to_flags(vars(args))


def run(args: argparse.Namespace) -> int:
    from lorafuse.train.engine import train
    from lorafuse.train.loop import TrainingInterrupted

    cfg = resolve_config(args)  # ConfigError / CheckpointError are LorafuseErrors: one line, exit 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
        return 0
    if not cfg.data:
        raise LorafuseError(
            "no training data: pass --data FILE [FILE ...] or set `data:` in --config"
        )
    if args.nproc:
        return _launch(args, cfg)
    try:
        summary = train(cfg)
    except TrainingInterrupted as stop:
        print(f"lorafuse train: {stop}", file=sys.stderr)
        return 130
    print(json.dumps(summary))
    return 0


def _launch(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """``--nproc``: torchrun's ranks, under this process's hold on the run directory (rank 0
    finds the lock held by its launcher and runs under it; ``lorafuse.train.run_dir``)."""
    import os

    from lorafuse.train import run_dir
    from lorafuse.train.launcher import launch_torchrun

    with run_dir.claim(cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite):
        env = {**os.environ, run_dir.LAUNCHER_ENV: str(os.getpid())}
        return launch_torchrun(args.nproc, to_argv(args), env=env)
