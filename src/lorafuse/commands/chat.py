"""`lorafuse chat`: terminal chat through the model's chat template, tokens streamed.

Commands: ``/reset`` (clear history), ``/system <text>`` (set the system prompt and reset),
``/exit``. Works with piped stdin too: each input line is one user turn, replies go to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lorafuse.commands._args import (
    add_model_arguments,
    add_sampling_arguments,
    dtype_from_args,
    sampling_from_args,
    spec_from_args,
)
from lorafuse.errors import LorafuseError
from lorafuse.generation import (
    GenerationResult,
    chat_stop_ids,
    context_length,
    encode_messages,
    has_chat_template,
    stream_generate,
)
from lorafuse.models.resolve import load_model

HELP = "commands: /reset  /system <text>  /exit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapters="one", compute_dtype=True)
    add_sampling_arguments(parser)
    parser.add_argument("--system", default=None, help="system prompt")


class ChatSession:
    """History + the model; ``reply(text)`` streams the assistant's answer to ``out``."""

    def __init__(self, model, tokenizer, params, system: str | None = None, out=sys.stdout):
        self.model, self.tokenizer, self.out = model, tokenizer, out
        # a reply ends at the template's end-of-turn token, which need not be the EOS
        stops = [*params.stop_token_ids, *chat_stop_ids(tokenizer)]
        self.params = dataclasses.replace(params, stop_token_ids=stops)
        self.system = system
        self.history: list[dict] = []

    def reset(self) -> None:
        self.history = []

    def messages(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.history

    def _prompt_ids(self) -> list[int]:
        # Drop the oldest turns (never the system prompt) until prompt + answer fit the context.
        budget = context_length(self.model) - self.params.max_new_tokens
        ids = encode_messages(self.tokenizer, self.messages())
        while len(ids) > budget and len(self.history) > 1:
            self.history = self.history[2:] if len(self.history) > 2 else self.history[1:]
            ids = encode_messages(self.tokenizer, self.messages())
        if len(ids) > budget:
            raise LorafuseError(
                f"prompt is {len(ids)} tokens; the context holds {budget} + max-new-tokens"
            )
        return ids

    def reply(self, text: str) -> GenerationResult:
        self.history.append({"role": "user", "content": text})
        result = GenerationResult()
        for piece in stream_generate(
            self.model, self.tokenizer, self._prompt_ids(), self.params, result=result
        ):
            self.out.write(piece)
            self.out.flush()
        self.out.write("\n")
        self.out.flush()
        self.history.append({"role": "assistant", "content": result.text})
        return result

    def handle(self, line: str) -> bool:
        """Process one input line; False means exit."""
        line = line.rstrip("\n")
        if not line.strip():
            return True
        if line.strip() in ("/exit", "/quit"):
            return False
        if line.strip() == "/reset":
            self.reset()
            print("[history cleared]", file=sys.stderr)
        elif line.startswith("/system"):
            self.system = line[len("/system") :].strip() or None
            self.reset()
            print(
                f"[system prompt {'set' if self.system else 'cleared'}; history cleared]",
                file=sys.stderr,
            )
        elif line.startswith("/"):
            print(f"unknown command {line.split()[0]}; {HELP}", file=sys.stderr)
        else:
            self.reply(line)
        return True


def run(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    spec = spec_from_args(args)
    model, tokenizer = load_model(spec, dtype=dtype_from_args(args))
    if not has_chat_template(tokenizer):
        raise LorafuseError(
            f"{spec.base_label}: the tokenizer has no chat template; use `lorafuse infer`"
        )
    session = ChatSession(model, tokenizer, params, system=args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        label = spec.base_label + (f" + {', '.join(spec.adapters)}" if spec.adapters else "")
        print(f"chatting with {label}. {HELP}", file=sys.stderr)
    while True:
        if interactive:
            print("\n>>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or not session.handle(line):
            return 0
