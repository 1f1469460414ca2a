"""JSONL of prompts in, JSONL of completions out: batched, resumable (what ``lorafuse infer`` runs).

    records = read_records("in.jsonl")
    done = done_indices(Path("out.jsonl"))
    todo = [i for i in range(len(records)) if i not in done]
    infer_records(model, tokenizer, records, todo, Path("out.jsonl"), SamplingParams(), "in.jsonl")

Input records hold ``"prompt"`` (text; wrapped as a user turn through the chat template unless
``raw``) or ``"messages"`` (a chat). For a vision-language model (a ``processor``), message contents
may be lists of parts with images (``{"type": "image", "image": path or data URL}``, OpenAI
``image_url``) or carry ``<image>`` placeholders with an ``"images"`` list; paths are relative to
the input file, and such records are generated one at a time. Each output line is the input record
plus ``"index"`` (its line number among the input records) and ``"completion"``. Every batch is
appended to the output in one write + fsync, so a killed run loses at most the batch in flight; a
rerun skips the indices already present (a torn last line from a kill is dropped first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

from tqdm.auto import tqdm

from lorafuse import files
from lorafuse.data.formats import DataError, has_image_parts, jsonl_objects
from lorafuse.data.vision import DEFAULT_MAX_PIXELS, load_image, normalize_vision
from lorafuse.data.vision_rows import prompt_inputs
from lorafuse.errors import LorafuseError
from lorafuse.generation import (
    GenerationResult,
    SamplingParams,
    chat_stop_ids,
    context_length,
    encode_messages,
    encode_prompt,
    generate_batch,
    has_chat_template,
    stream_generate,
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


def append_rows(path: Path, rows: list[dict], then: str = "") -> None:
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


def encode_record(tokenizer, rec: dict, raw: bool) -> list[int]:
    if "messages" in rec and not isinstance(rec.get("prompt"), str):
        return encode_messages(tokenizer, rec["messages"])
    if raw or not has_chat_template(tokenizer):
        return encode_prompt(tokenizer, rec["prompt"])
    return encode_messages(tokenizer, [{"role": "user", "content": rec["prompt"]}])


def infer_records(model, tokenizer, records: list[dict], todo: list[int], output: Path,
                  params: SamplingParams, source: str, *, processor=None, raw: bool = False,
                  batch_size: int = 8, engine=None) -> int:  # fmt: skip
    """Append a completion of every record index in ``todo`` to ``output`` (``batch_size`` at a
    time; a vision-language model's one by one); returns how many were written. ``source``: the
    input file (errors name it; image paths are relative to it). ``engine``: the decode engine
    for a text model (:func:`lorafuse.generation.generate_batch`)."""
    if any("messages" in r for r in records) or not raw:  # chat replies: end of turn too
        params = dataclasses.replace(params, stop_token_ids=chat_stop_ids(tokenizer))
    limit = context_length(model) - params.max_new_tokens
    if processor is not None:
        return _infer_vision(model, processor, records, todo, output, params, limit, source)
    for i in todo:
        if has_image_parts(records[i]):
            raise LorafuseError(
                f"{source}: record {i} has images, but the model is text-only (no vision tower)"
            )
    bar = tqdm(total=len(records), initial=len(records) - len(todo), desc="infer", unit="rec")
    try:  # the bar closed before an error line is printed under it
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            prompts = [encode_record(tokenizer, records[i], raw) for i in batch]
            for i, p in zip(batch, prompts):
                _check_length(source, i, len(p), limit)
            texts = generate_batch(model, tokenizer, prompts, params, engine, batch_size)
            then = (f"the half-written batch was cut off; {len(records) - len(todo) + start} of "
                    f"{len(records)} records are in it; free space and rerun the same command "
                    "(it skips them)")  # fmt: skip
            rows = [{**records[i], "index": i, "completion": t} for i, t in zip(batch, texts)]
            append_rows(output, rows, then)
            bar.update(len(batch))
    finally:
        bar.close()
    return len(todo)


def _check_length(source: str, i: int, n: int, limit: int) -> None:
    if n > limit:
        raise LorafuseError(
            f"{source}: record {i}: prompt is {n} tokens, over the {limit} the context leaves"
        )


def _infer_vision(model, processor, records, todo, output: Path, params, limit: int,
                  source: str) -> int:  # fmt: skip
    """A vision-language model: one record at a time (each has its own images)."""
    base = str(Path(source).resolve().parent)
    for i in tqdm(todo, desc="infer", unit="rec"):
        rec = records[i]
        if isinstance(rec.get("prompt"), str) and "messages" not in rec:
            rec = {**rec, "messages": [{"role": "user", "content": rec["prompt"]}]}
        try:
            ex = normalize_vision(rec, f"{source}: record {i}", base, need_answer=False)
            images = [load_image(ref, base, DEFAULT_MAX_PIXELS) for ref in ex.images]
        except ValueError as err:
            raise LorafuseError(f"{source}: record {i}: {err}") from None
        ids, extra = prompt_inputs(processor, ex.messages, images)
        _check_length(source, i, len(ids), limit)
        result = GenerationResult()
        for _ in stream_generate(
            model, processor.tokenizer, ids, params, result=result, inputs=extra
        ):
            pass
        append_rows(output, [{**records[i], "index": i, "completion": result.text}])
    return len(todo)
