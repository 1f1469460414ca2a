"""lorafuse: LoRA / QLoRA fine-tuning, fast and exact, from train to serve.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only wires them up (imported lazily so ``lorafuse --help`` is instant).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("lorafuse.train.cli", "fine-tune a model with LoRA / QLoRA"),
    "chat": ("lorafuse.serve.chat_cli", "chat with a model (+ adapter) in the terminal"),
    "infer": ("lorafuse.serve.infer_cli", "batch generation: JSONL of prompts in, completions out"),
    "merge": ("lorafuse.export.merge_cli", "fold an adapter into the base weights"),
    "export": ("lorafuse.export.export_cli", "export to GGUF or safetensors"),
    "serve": ("lorafuse.serve.server_cli", "OpenAI-compatible HTTP server"),
    "eval": ("lorafuse.evaluation.cli", "perplexity and exact-match evaluation"),
    "bench": ("lorafuse.bench", "training-speed benchmark: stock transformers + PEFT vs lorafuse"),
    "build-ext": ("lorafuse.build_ext_cli", "compile the C++ CPU kernels ahead of time"),
}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafuse", description=__doc__.splitlines()[0])
    from lorafuse import __version__

    parser.add_argument("--version", action="version", version=f"lorafuse {__version__}")
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
    except CLIError as err:
        print(f"lorafuse {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lorafuse {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
