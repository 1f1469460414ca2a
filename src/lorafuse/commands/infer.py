"""`lorafuse infer`: JSONL of prompts in, JSONL of completions out; batched, resumable.

Input records hold ``"prompt"`` (text; wrapped as a user turn through the chat template unless
``--raw``) or ``"messages"`` (a chat). For a vision-language model, message contents may be lists
of parts with images (``{"type": "image", "image": path or data URL}``, OpenAI ``image_url``) or
carry ``<image>`` placeholders with an ``"images"`` list; paths are relative to the input file,
and such records are generated one at a time. Each output line is the input record plus ``"index"``
(its line number among the input records) and ``"completion"``. Every batch is appended to the
output in one write + fsync, so a killed run loses at most the batch in flight; a rerun skips
the indices already present (a torn last line from a kill is dropped first).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from pathlib import Path

from tqdm.auto import tqdm

from lorafuse import files
from lorafuse.commands._args import (
    add_decode_argument,
    add_model_arguments,
    add_sampling_arguments,
    dtype_from_args,
    engine_from_args,
    sampling_from_args,
    spec_from_args,
)
from lorafuse.data.formats import DataError, has_image_parts, jsonl_objects
from lorafuse.data.vision import DEFAULT_MAX_PIXELS, load_image, normalize_vision
from lorafuse.data.vision_rows import prompt_inputs
from lorafuse.errors import LorafuseError
from lorafuse.generation import (
    GenerationResult,
    chat_stop_ids,
    context_length,
    encode_messages,
    encode_prompt,
    generate_batch,
    has_chat_template,
    stream_generate,
)
from lorafuse.models.resolve import load_model


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


def read_records(path: str | os.PathLike) -> list[dict]:
    """Parse and validate the input; errors name the file and line."""
    records = []
    try:
        for lineno, rec in jsonl_objects(path):
            msgs = rec.get("messages")
            if not isinstance(rec.get("prompt"), str) and not (
                isinstance(msgs, list) and msgs and all(_is_message(m) for m in msgs)
            ):
                raise LorafuseError(
                    f"{path}:{lineno}: needs 'prompt' (string) or 'messages' (non-empty list of "
                    "{'role': str, 'content': str or a list of parts})"
                )
            records.append(rec)
    except DataError as err:
        raise LorafuseError(str(err)) from err
    return records


def _is_message(m) -> bool:
    return (
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str | list)  # a list of parts: vision-language models
    )


def done_indices(path: Path) -> set[int]:
    """Indices already in the output; a torn (unparseable) last line is cut off the file."""
    if not path.is_file():
        return set()
    raw = path.read_text(encoding="utf-8")
    lines = raw.splitlines(keepends=True)
    done, keep = set(), []
    for i, line in enumerate(lines):
        try:
            done.add(int(json.loads(line)["index"]))
            keep.append(line if line.endswith("\n") else line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            if i != len(lines) - 1:
                raise LorafuseError(
                    f"{path}:{i + 1}: not a lorafuse infer output line ({err})"
                ) from err
    if "".join(keep) != raw:  # rewrite without the torn tail, atomically
        files.write_text(path, "".join(keep))
    return done


def _append(path: Path, rows: list[dict], then: str = "") -> None:
    """Append one batch. A full disk cuts the file back to before the batch (no torn line) and
    ends in one line saying so."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    size = path.stat().st_size if path.exists() else 0
    with files.disk_full_as_error("completions", path, len(data), then):
        try:
            with open(path, "ab") as f:
                f.write(data)  # one write per batch, then fsync: on disk or (torn) dropped
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.truncate(path, size)
            raise


def _encode(tokenizer, rec: dict, raw: bool) -> list[int]:
    if "messages" in rec and not isinstance(rec.get("prompt"), str):
        return encode_messages(tokenizer, rec["messages"])
    if raw or not has_chat_template(tokenizer):
        return encode_prompt(tokenizer, rec["prompt"])
    return encode_messages(tokenizer, [{"role": "user", "content": rec["prompt"]}])


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
    model, tokenizer, processor = load_model(spec_from_args(args), dtype=dtype_from_args(args))
    if any("messages" in r for r in records) or not args.raw:  # chat replies: end of turn too
        params = dataclasses.replace(params, stop_token_ids=chat_stop_ids(tokenizer))
    limit = context_length(model) - params.max_new_tokens
    if processor is not None:
        return _run_vision(args, model, processor, records, todo, out, params, limit)
    for i in todo:
        if has_image_parts(records[i]):
            raise LorafuseError(
                f"{args.input}: record {i} has images, but the model is text-only (no vision tower)"
            )
    engine = engine_from_args(model, args)
    bar = tqdm(total=len(records), initial=len(records) - len(todo), desc="infer", unit="rec")
    try:  # the bar closed before an error line is printed under it
        for start in range(0, len(todo), args.batch_size):
            batch = todo[start : start + args.batch_size]
            prompts = [_encode(tokenizer, records[i], args.raw) for i in batch]
            for i, p in zip(batch, prompts):
                if len(p) > limit:
                    raise LorafuseError(
                        f"{args.input}: record {i}: prompt is {len(p)} tokens, over the {limit} the context leaves"
                    )
            texts = generate_batch(model, tokenizer, prompts, params, engine, args.batch_size)
            then = (f"the half-written batch was cut off; {len(records) - len(todo) + start} of "
                    f"{len(records)} records are in it; free space and rerun the same command "
                    "(it skips them)")  # fmt: skip
            rows = [{**records[i], "index": i, "completion": t} for i, t in zip(batch, texts)]
            _append(out, rows, then)
            bar.update(len(batch))
    finally:
        bar.close()
    print(f"wrote {len(todo)} completions to {out} ({len(done)} were already there)")
    return 0


def _run_vision(args, model, processor, records, todo, out: Path, params, limit: int) -> int:
    """A vision-language model: one record at a time (each has its own images)."""
    base = str(Path(args.input).resolve().parent)
    for i in tqdm(todo, desc="infer", unit="rec"):
        rec = records[i]
        if isinstance(rec.get("prompt"), str) and "messages" not in rec:
            rec = {**rec, "messages": [{"role": "user", "content": rec["prompt"]}]}
        try:
            ex = normalize_vision(rec, f"{args.input}: record {i}", base, need_answer=False)
            images = [load_image(ref, base, DEFAULT_MAX_PIXELS) for ref in ex.images]
        except ValueError as err:
            raise LorafuseError(f"{args.input}: record {i}: {err}") from None
        ids, extra = prompt_inputs(processor, ex.messages, images)
        if len(ids) > limit:
            raise LorafuseError(
                f"{args.input}: record {i}: prompt is {len(ids)} tokens, over the {limit} the context leaves"
            )
        result = GenerationResult()
        for _ in stream_generate(
            model, processor.tokenizer, ids, params, result=result, inputs=extra
        ):
            pass
        _append(out, [{**records[i], "index": i, "completion": result.text}])
    print(f"wrote {len(todo)} completions to {out}")
    return 0
