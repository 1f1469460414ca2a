"""`lorafuse chat`: terminal chat through the model's chat template, tokens streamed.

Commands: ``/reset`` (clear history), ``/system <text>`` (set the system prompt and reset),
``/image <path>`` (a vision-language model: attach an image to the next turn), ``/exit``.
``--image PATH`` attaches images to the first turn. Works with piped stdin too: each input line
is one user turn, replies go to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lorafuse.commands._args import (
    add_decode_argument,
    add_model_arguments,
    add_sampling_arguments,
    dtype_from_args,
    engine_from_args,
    sampling_from_args,
    spec_from_args,
)
from lorafuse.data.vision import DEFAULT_MAX_PIXELS, load_image
from lorafuse.data.vision_rows import prompt_inputs
from lorafuse.errors import LorafuseError
from lorafuse.generation import (
    GenerationResult,
    chat_stop_ids,
    context_length,
    encode_messages,
    has_chat_template,
    stream_generate,
)
from lorafuse.models.resolve import load_resolved

HELP = "commands: /reset  /system <text>  /image <path>  /exit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapters="one", compute_dtype=True)
    add_sampling_arguments(parser)
    add_decode_argument(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument(
        "--image", action="append", default=[], metavar="PATH",
        help="an image for the first turn (vision-language models; repeat for several)",
    )  # fmt: skip


class ChatSession:
    """History + the model; ``reply(text)`` streams the assistant's answer to ``out``
    (``engine``: as :func:`lorafuse.generation.stream_generate` takes it)."""

    def __init__(self, model, tokenizer, params, system: str | None = None, out=sys.stdout,
                 processor=None, images=(), engine="auto"):  # fmt: skip
        self.model, self.tokenizer, self.out, self.engine = model, tokenizer, out, engine
        # a reply ends at the template's end-of-turn token, which need not be the EOS
        stops = [*params.stop_token_ids, *chat_stop_ids(tokenizer)]
        self.params = dataclasses.replace(params, stop_token_ids=stops)
        self.system = system
        self.processor = processor  # a vision-language model's: turns are lists of parts
        self.history: list[dict] = []
        self.images: list = []  # of the history's image parts, in order
        self.pending: list = []  # for the next user turn
        for path in images:
            self.attach(path)

    def reset(self) -> None:
        self.history, self.images, self.pending = [], [], []

    def attach(self, path: str) -> None:
        if self.processor is None:
            raise LorafuseError("images need a vision-language model; this one is text-only")
        try:
            self.pending.append(load_image(path, max_pixels=DEFAULT_MAX_PIXELS))
        except ValueError as err:
            raise LorafuseError(str(err)) from None

    def _text(self, text: str) -> str | list[dict]:
        return text if self.processor is None else [{"type": "text", "text": text}]

    def messages(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self._text(self.system)}] if self.system else []
        return sys_msg + self.history

    def _encode(self) -> tuple[list[int], dict]:
        if self.processor is None:
            return encode_messages(self.tokenizer, self.messages()), {}
        return prompt_inputs(self.processor, self.messages(), self.images)

    def _drop_oldest(self) -> None:
        dropped = self.history[:2] if len(self.history) > 2 else self.history[:1]
        self.history = self.history[len(dropped) :]
        n = sum(p["type"] == "image" for m in dropped if isinstance(m["content"], list)
                for p in m["content"])  # fmt: skip
        self.images = self.images[n:]

    def _prompt(self) -> tuple[list[int], dict]:
        # Drop the oldest turns (never the system prompt) until prompt + answer fit the context.
        budget = context_length(self.model) - self.params.max_new_tokens
        ids, extra = self._encode()
        while len(ids) > budget and len(self.history) > 1:
            self._drop_oldest()
            ids, extra = self._encode()
        if len(ids) > budget:
            raise LorafuseError(
                f"prompt is {len(ids)} tokens; the context holds {budget} + max-new-tokens"
            )
        return ids, extra

    def reply(self, text: str) -> GenerationResult:
        content = self._text(text)
        if self.pending:
            content = [{"type": "image"} for _ in self.pending] + content
            self.images, self.pending = self.images + self.pending, []
        self.history.append({"role": "user", "content": content})
        result = GenerationResult()
        ids, extra = self._prompt()
        for piece in stream_generate(
            self.model, self.tokenizer, ids, self.params, result=result, inputs=extra,
            engine=self.engine,
        ):  # fmt: skip
            self.out.write(piece)
            self.out.flush()
        self.out.write("\n")
        self.out.flush()
        self.history.append({"role": "assistant", "content": self._text(result.text)})
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
        elif line.startswith("/image"):
            self.attach(line[len("/image") :].strip())
            print(f"[{len(self.pending)} image(s) for the next turn]", file=sys.stderr)
        elif line.startswith("/"):
            print(f"unknown command {line.split()[0]}; {HELP}", file=sys.stderr)
        else:
            self.reply(line)
        return True


def run(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    spec = spec_from_args(args)
    model, tokenizer, processor = load_resolved(spec, dtype=dtype_from_args(args))
    if not has_chat_template(tokenizer):
        raise LorafuseError(
            f"{spec.base_label}: the tokenizer has no chat template; use `lorafuse infer`"
        )
    if args.image and processor is None:
        raise LorafuseError(f"--image: {spec.base_label} is a text-only model (no vision tower)")
    engine = None if processor is not None else engine_from_args(model, args)
    session = ChatSession(model, tokenizer, params, system=args.system, processor=processor,
                          images=args.image, engine=engine)  # fmt: skip
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
