"""Dataset preview: what the trainer would make of a file, before a run is launched.

Reads the file with the trainer's own reader (``lorafuse.data.formats.read_examples``, malformed
records skipped and reported with ``file:line`` and the library's message), tokenizes every
example with ``lorafuse.data.masking.encode`` using the config's model tokenizer (default: the
built-in SmolLM2 one; tokenizers are cached per model), and counts what ``too_long`` would do:
``truncate`` -> truncated, ``drop`` -> dropped, ``error`` -> rejected with the trainer's message.
At most ``MAX_RECORDS`` examples are tokenized (``n_measured`` says how many); the counts then
cover those.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from lorafuse.data.formats import DataError, LoadStats, detect_format, read_examples, source_rows
from lorafuse.data.masking import THINK_TOKENS, TOO_LONG, encode
from lorafuse.data.read_options import ReadOptions, map_columns
from lorafuse.ui.errors import BadRequest
from lorafuse.ui.security import relative

MAX_RECORDS = 5000
N_BINS = 20
SHOWN_REJECTED = 50


@functools.lru_cache(maxsize=4)
def tokenizer_for(model: str | None):
    """The tokenizer of ``model`` (HF dir, .gguf, hub id in the local cache, None = default)."""
    from transformers import AutoTokenizer

    from lorafuse.models.source import resolve_model_source

    tok = AutoTokenizer.from_pretrained(resolve_model_source(model))
    return tok


def _detect(path: str, data_format: str, options: ReadOptions) -> str:
    if data_format != "auto":
        return data_format
    _, rows = source_rows(path, options)
    for _, record in rows:
        if isinstance(record, dict):
            try:
                record = map_columns(record, options.columns)
            except ValueError:
                continue
            try:
                return detect_format(record)
            except ValueError:
                return "unknown"
    return "unknown"


def _row(example) -> dict:
    if example.messages is not None:
        return {"source": example.source, "messages": example.messages}
    return {"source": example.source, "prompt": example.prompt, "completion": example.completion}


def shown(workspace, source: str) -> str:
    """A source as the page shows it: a workspace path relative, a hub id as it is."""
    return relative(workspace, source) if Path(source).exists() else source


def _split_source(message: str, files: list[str], workspace) -> dict:
    """``"<file>:<line>: <problem>"`` (the library's DataError text; a dataset's file is
    ``name[split]``) -> {file, line, message}."""
    for f in files:
        head, sep, tail = message.partition(": ")
        label, _, line = head.rpartition(":")
        if sep and line.isdigit() and (label == f or label.startswith(f + "[")):
            return {"file": shown(workspace, f), "line": int(line), "message": tail}
    return {"file": None, "line": None, "message": message}


def histogram(lengths: list[int], limit: int) -> dict:
    """``N_BINS`` equal bins from 0 to max(longest, limit): {bins: edges (N+1), counts (N)}."""
    top = max([limit, *lengths]) if lengths else limit
    width = max(1, math.ceil(top / N_BINS))
    counts = [0] * N_BINS
    for n in lengths:
        counts[min(N_BINS - 1, n // width)] += 1
    return {"bins": [i * width for i in range(N_BINS + 1)], "counts": counts}


def preview(path: Path | str, workspace, *, data_format: str = "auto", max_seq_length: int = 2048,
            model: str | None = None, too_long: str = "truncate", train_on_inputs: bool = False,
            options: ReadOptions | None = None, think_tokens: str = "mask-empty") -> dict:  # fmt: skip
    """The preview of one data source (a file or dataset folder already resolved inside the
    workspace, or a hub id)."""
    if too_long not in TOO_LONG:
        raise BadRequest(f"too_long={too_long!r}: one of {', '.join(TOO_LONG)}")
    if think_tokens not in THINK_TOKENS:
        raise BadRequest(f"think_tokens={think_tokens!r}: one of {', '.join(THINK_TOKENS)}")
    file = str(path)
    stats = LoadStats()
    try:
        options = options or ReadOptions()
        examples = read_examples([file], data_format, skip_bad=True, stats=stats, options=options)
        fmt = _detect(file, data_format, options)
    except DataError as err:
        raise BadRequest(str(err)) from None
    rejected = [_split_source(m, [file], workspace) for m in stats.skipped_examples]
    tok = tokenizer_for(model)
    lengths, truncated, dropped, no_targets = [], 0, 0, 0
    for ex in examples[:MAX_RECORDS]:
        try:  # the full length first: the histogram shows how far past the limit records go
            full = encode(
                ex, tok, 10**9, train_on_inputs=train_on_inputs, think_tokens=think_tokens
            )
        except DataError as err:
            rejected.append(_split_source(str(err), [file], workspace))
            continue
        n = len(full.input_ids)
        lengths.append(n)
        if n > max_seq_length:
            if too_long == "truncate":
                truncated += 1
            elif too_long == "drop":
                dropped += 1
                continue
            else:
                try:
                    encode(ex, tok, max_seq_length, too_long="error", think_tokens=think_tokens)
                except DataError as err:
                    rejected.append(_split_source(str(err), [file], workspace))
                continue
        kept = full.labels[:max_seq_length]
        if not any(t != -100 for t in kept):
            no_targets += 1
    n_rejected = stats.skipped + len(rejected) - len(stats.skipped_examples)
    return {
        "path": shown(workspace, file), "format": fmt,
        "n_records": stats.records + stats.skipped, "n_examples": len(examples),
        "n_measured": min(len(examples), MAX_RECORDS),
        "first_rows": [_row(e) for e in examples[:5]],
        "lengths": histogram(lengths, max_seq_length),
        "max_length": max(lengths, default=0),
        "mean_length": sum(lengths) / len(lengths) if lengths else 0.0,
        "max_seq_length": max_seq_length, "too_long": too_long,
        "truncated": truncated, "dropped": dropped, "no_targets": no_targets,
        "n_rejected": n_rejected, "rejected": rejected[:SHOWN_REJECTED],
        "tokenizer": model or "SmolLM2-135M-Instruct (built-in)",
    }  # fmt: skip
