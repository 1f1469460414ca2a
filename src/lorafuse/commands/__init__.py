"""lorafuse: LoRA / QLoRA fine-tuning, fast and exact, from train to serve.

The command layer: the only code that parses arguments or prints for a terminal, and nothing in
the library imports it. Each subcommand is a module here exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file wires them up (imported lazily so ``lorafuse --help`` is instant)
and turns the library's :class:`~lorafuse.errors.LorafuseError` into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from lorafuse.errors import LorafuseError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("lorafuse.commands.train", "fine-tune a model with LoRA / QLoRA"),
    "train-image": (
        "lorafuse.commands.train_image",
        "train a Stable Diffusion / SDXL LoRA (kohya format) from an image folder",
    ),
    "chat": ("lorafuse.commands.chat", "chat with a model (+ adapter) in the terminal"),
    "infer": ("lorafuse.commands.infer", "batch generation: JSONL of prompts in, completions out"),
    "merge": ("lorafuse.commands.merge", "fold an adapter into the base weights"),
    "export": ("lorafuse.commands.export", "export to GGUF or safetensors"),
    "serve": ("lorafuse.commands.serve", "OpenAI-compatible HTTP server"),
    "eval": ("lorafuse.commands.eval", "perplexity and exact-match evaluation"),
    "bench": (
        "lorafuse.commands.bench",
        "training-speed benchmark: stock transformers + PEFT vs lorafuse",
    ),
    "build-ext": ("lorafuse.commands.build_ext", "compile the C++ CPU kernels ahead of time"),
    "ui": (
        "lorafuse.commands.ui",
        "web UI: launch, watch, stop, resume, chat with and export runs",
    ),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafuse", description=__doc__.splitlines()[0])
    from lorafuse import __version__

    parser.add_argument("--version", action="version", version=f"lorafuse {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback behind an error line"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only import the module that will run
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 0 if not argv else 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except LorafuseError as err:
        if args.debug:
            traceback.print_exc()
        print(f"lorafuse {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lorafuse {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
