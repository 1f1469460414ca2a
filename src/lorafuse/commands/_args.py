"""Flags several commands share: which model (+ adapters), which compute dtype, how to sample."""

from __future__ import annotations

import argparse
import dataclasses

from lorafuse import decode
from lorafuse.errors import LorafuseError
from lorafuse.generation import SamplingParams
from lorafuse.models.resolve import ModelSpec, resolve_spec
from lorafuse.models.source import say

COMPUTE_DTYPES = ("auto", "fp32", "bf16", "fp16")


def add_model_arguments(
    parser: argparse.ArgumentParser, adapters: str = "one", compute_dtype: bool = False
) -> None:
    """--checkpoint / --model / --adapter (adapters: 'one', 'many' (NAME=PATH, repeatable), 'none');
    with ``compute_dtype``, also ``--dtype`` (the dtype the model runs in)."""
    g = parser.add_argument_group("model")
    g.add_argument("--checkpoint", help="training checkpoint / adapter dir (finds its base model)")
    g.add_argument(
        "--model", help="base model: HF dir, .gguf file or merged dir (default: SmolLM2)"
    )
    if adapters == "one":
        g.add_argument("--adapter", help="PEFT adapter dir to apply on --model")
    elif adapters == "many":
        g.add_argument(
            "--adapter", action="append", default=[], metavar="NAME=PATH",
            help="named adapter served as its own model id (repeatable)",
        )  # fmt: skip
    if compute_dtype:
        g.add_argument(
            "--dtype", choices=COMPUTE_DTYPES, default="auto",
            help="dtype the model runs in (auto: bf16 where this device multiplies bf16 natively, "
            "else fp32)",
        )  # fmt: skip


DECODE_CHOICES = (*decode.WEIGHTS, "model")


def add_decode_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--decode", choices=DECODE_CHOICES, default="auto",
        help="how tokens are generated: auto = the decode engine with the weights as loaded "
        "where it runs the model (dense Llama-family), else the model's own forward; "
        "fp32 / bf16 / fp16 / int8 / q4 = the engine with the frozen base in that format "
        "(int8, q4: quantized for decoding, 32 weights per scale); model = the model's forward",
    )  # fmt: skip


def engine_from_args(model, args: argparse.Namespace):
    """The decode engine ``--decode`` asks for (None: the model's forward), said in one line on
    stderr; an explicit weight format the engine cannot run is an error."""
    choice = getattr(args, "decode", "auto")
    if choice == "model":
        say("generation: the model's own forward (--decode model)")
        return None
    engine = decode.engine_for(model, choice)
    if engine is None:
        reason = decode.unavailable_reason(model, choice)
        if choice != "auto":
            raise LorafuseError(f"--decode {choice}: {reason}")
        say(f"generation: the model's own forward ({reason})")
        return None
    say(f"generation: {engine.describe()}")
    return engine


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    adapter = getattr(args, "adapter", None)
    adapters = adapter if isinstance(adapter, list) else ([adapter] if adapter else [])
    return resolve_spec(args.checkpoint, args.model, adapters)


def dtype_from_args(args: argparse.Namespace) -> str | None:
    """``--dtype`` as the loaders take it: None for auto, else the name (fp32 | bf16 | fp16)."""
    dtype = getattr(args, "dtype", "auto")
    return None if dtype == "auto" else dtype


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int = 256) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as :class:`SamplingParams` (which validates them)."""
    try:
        return SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=list(args.stop),
        )  # fmt: skip
    except LorafuseError as err:
        raise LorafuseError(
            "need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0, --max-new-tokens >= 1"
        ) from err


def _arg_type(annotation: str):
    """(element type, is_list, is_bool) from a dataclass field's annotation string."""
    names = {"int": int, "float": float, "str": str}
    ann = annotation.replace(" | None", "").strip()
    if ann == "bool":
        return bool, False, True
    if ann.startswith("list["):
        return names[ann[5:-1]], True, False
    return names[ann], False, False


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of the config dataclass ``cls`` (``lr_scheduler`` -> ``--lr-scheduler``).

    Help is the field's ``help`` metadata plus its default; bools get ``--x/--no-x``; lists take
    ``nargs`` from the metadata. Defaults are suppressed so that only the flags actually given
    override a config file or a checkpoint's stored config.
    """
    defaults = cls()
    group_of = {name: g for g, names in getattr(cls, "groups", dict)().items() for name in names}
    sections = {
        g: parser.add_argument_group(f"{g} settings") for g in dict.fromkeys(group_of.values())
    }
    for f in dataclasses.fields(cls):
        target = sections.get(group_of.get(f.name), parser)  # --help lists the fields by group
        elem, is_list, is_bool = _arg_type(str(f.type))
        flag = "--" + f.name.replace("_", "-")
        # argparse %-formats help strings: escape the field docs and the default's repr
        help_text = f"{f.metadata['help']} (default: {getattr(defaults, f.name)!r})"
        kw: dict = {
            "dest": f.name,
            "default": argparse.SUPPRESS,
            "help": help_text.replace("%", "%%"),
        }
        if is_bool:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif is_list:
            if "action" in f.metadata:  # "extend": the flag may be repeated
                kw["action"] = f.metadata["action"]
            target.add_argument(flag, type=elem, nargs=f.metadata.get("nargs", "+"), **kw)
        else:
            target.add_argument(flag, type=elem, **kw)
