"""Dataset files and record formats, normalised to one canonical example.

Sources: ``.jsonl``, ``.json`` (a list, or ``{"data": [...]}``), ``.csv``, ``.parquet`` and
Hugging Face datasets (:mod:`lorafuse.data.hf_datasets`); :class:`ReadOptions` picks a split and
subset and renames columns (``prompt=question``) first (docs/training.md, Data).

Record formats (``detect_format`` looks at the keys of the first record of each file):

=================  =====================================================  ==========================
name               keys                                                   becomes
=================  =====================================================  ==========================
messages           ``messages: [{role, content}, ...]`` (OpenAI); an       chat messages
                   optional ``answer`` is appended as the assistant turn
                   (the eval-task format of ``lorafuse eval`` / the demo);
                   an assistant turn's ``reasoning_content`` (or
                   ``reasoning``) is kept for the chat template
sharegpt           ``conversations: [{from, value}, ...]``                 chat messages
alpaca             ``instruction``, optional ``input``, ``output``         chat messages
prompt_completion  ``prompt``, ``completion``                              raw text, loss on completion
text               ``text``                                               raw text, loss on all of it
=================  =====================================================  ==========================

Every problem is reported as ``DataError("<file>:<line>: <problem>")``; with ``skip_bad=True``
malformed records are skipped and counted instead.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafuse.data import hf_datasets
from lorafuse.data.read_options import ReadOptions, map_columns
from lorafuse.errors import LorafuseError

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
}
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class DataError(LorafuseError, ValueError):
    """A dataset problem, with the file and line (or record number) it happened at."""


@dataclass
class Example:
    """One normalised training example.

    Exactly one of ``messages`` (chat, rendered with the tokenizer's chat template) or
    ``prompt``/``completion`` (raw text) is set; plain ``text`` is a completion with an empty prompt.
    ``source`` is ``"file:line"`` for error messages.
    """

    source: str
    messages: list[dict[str, str]] | None = None
    prompt: str = ""
    completion: str = ""


@dataclass
class LoadStats:
    """What happened while reading: counts per file, skipped records and why."""

    records: int = 0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)  # first few "file:line: problem"

    def skip(self, err: DataError) -> None:
        self.skipped += 1
        if len(self.skipped_examples) < 5:
            self.skipped_examples.append(str(err))


def detect_format(record: dict) -> str:
    """Name the record format from its keys (see the module table), or raise ``ValueError``."""
    keys = set(record)
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if "text" in keys:
        return "text"
    raise ValueError(
        f"unknown record format: keys {sorted(keys)}; expected one of messages | conversations "
        "| instruction+output (alpaca) | prompt+completion | text"
    )


def _require_str(record: dict, key: str, *, optional: bool = False) -> str:
    if key not in record or record[key] is None or _is_nan(record[key]):
        if optional:
            return ""
        raise ValueError(f"missing field {key!r}")
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def _is_nan(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)


def as_list(value: object, key: str) -> list:
    if isinstance(value, str):  # CSV / Parquet cells hold JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"field {key!r} is a string that is not JSON ({err.msg})") from None
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {key!r} must be a non-empty list of turns")
    return value


def _messages(record: dict) -> list[dict[str, str]]:
    out = []
    for i, turn in enumerate(as_list(record.get("messages"), "messages")):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if turn["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role={turn['role']!r} is not one of {ROLES}")
        if not isinstance(turn["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")
        out.append(with_reasoning({"role": turn["role"], "content": turn["content"]}, turn,
                                  f"messages[{i}]"))  # fmt: skip
    if "answer" in record and out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": _require_str(record, "answer")})
    return out


REASONING_KEYS = ("reasoning_content", "reasoning")  # Qwen3 / DeepSeek-R1 / vLLM; OpenRouter


def with_reasoning(out: dict, turn: dict, where: str) -> dict:
    """``out`` plus the assistant ``turn``'s reasoning as ``reasoning_content`` (the name chat
    templates read), where it has a non-empty one; ``ValueError`` if it is not a string."""
    for key in REASONING_KEYS:
        value = turn.get(key)
        if value is None or _is_nan(value) or value == "":
            continue
        if not isinstance(value, str):
            raise ValueError(f"{where}.{key} must be a string")
        if out["role"] != "assistant":
            raise ValueError(f"{where}.{key}: only assistant turns carry reasoning")
        out["reasoning_content"] = value
        break
    return out


def _sharegpt(record: dict) -> list[dict[str, str]]:
    out = []
    for i, turn in enumerate(as_list(record.get("conversations"), "conversations")):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise ValueError(f"conversations[{i}] must be an object with 'from' and 'value'")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise ValueError(
                f"conversations[{i}].from={turn['from']!r} is not one of {sorted(SHAREGPT_ROLES)}"
            )
        if not isinstance(turn["value"], str):
            raise ValueError(f"conversations[{i}].value must be a string")
        out.append({"role": role, "content": turn["value"]})
    return out


def has_image_parts(record: object) -> bool:
    """Whether a raw record carries images (an ``images`` column or an image content part)."""
    if not isinstance(record, dict):
        return False
    if record.get("images"):
        return True
    turns = record.get("messages") or []
    return any(
        isinstance(t, dict) and isinstance(t.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in t["content"])
        for t in turns if isinstance(t, (dict,))
    )  # fmt: skip


def normalize(record: object, fmt: str, source: str) -> Example:
    """Turn one raw record of format ``fmt`` into an :class:`Example`; ``ValueError`` if malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"record must be a JSON object, got {type(record).__name__}")
    if has_image_parts(record):
        raise ValueError(
            "record has images, but the model is text-only (no vision tower in its config): "
            "train a vision-language model (Qwen2-VL, SmolVLM...) or drop the images"
        )
    if fmt == "messages":
        msgs = _messages(record)
    elif fmt == "sharegpt":
        msgs = _sharegpt(record)
    elif fmt == "alpaca":
        user = _require_str(record, "instruction")
        extra = _require_str(record, "input", optional=True)
        user = f"{user}\n\n{extra}" if extra else user
        msgs = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": _require_str(record, "output")},
        ]
    elif fmt == "prompt_completion":
        return Example(
            source,
            prompt=_require_str(record, "prompt"),
            completion=_require_str(record, "completion"),
        )
    elif fmt == "text":
        return Example(source, completion=_require_str(record, "text"))
    else:
        raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("conversation has no assistant turn, so nothing to learn")
    return Example(source, messages=msgs)


def read_text(path: str | os.PathLike) -> str:
    """A data file's text: UTF-8, a leading byte-order mark dropped (many Windows editors write one).

    Raises :class:`DataError` naming the file for unreadable files, and the line and byte for
    text that is not UTF-8.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {path}: {err}") from err
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        lineno = raw.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); "
            "re-save the file as UTF-8"
        ) from None


def jsonl_objects(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, object)`` for each non-blank line of a JSONL file.

    Raises :class:`DataError` naming the file (and line) for unreadable files, invalid JSON and
    lines that are not JSON objects. For inputs that must be clean (prompts, eval tasks).
    """
    for lineno, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        yield lineno, record


def raw_records(path: str) -> Iterator[tuple[int, object]]:
    """Yield ``(line_or_row_number, record)``; undecodable JSONL lines yield a ``DataError``."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".jsonl":
        for lineno, line in enumerate(read_text(path).split("\n"), 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                yield (
                    lineno,
                    DataError(f"{path}:{lineno}: invalid JSON ({err.msg} at column {err.colno})"),
                )
    elif suffix == ".json":
        try:
            data = json.loads(read_text(path))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataError(
                f"{path}: a .json dataset must be a list of records or {{'data': [...]}}"
            )
        yield from enumerate(data, 1)  # "line" = record number
    elif suffix in (".csv", ".parquet"):
        try:
            import pandas as pd
        except ImportError:
            raise DataError(
                f"{path}: reading {suffix} files needs pandas (pip install pandas pyarrow)"
            ) from None
        if suffix == ".csv":
            read_text(path)  # BOM and encoding checks with file:line errors, before pandas
            frame = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
        else:
            frame = pd.read_parquet(path)
        first = 2 if suffix == ".csv" else 1  # CSV: line 1 is the header
        for i, row in enumerate(frame.to_dict(orient="records")):
            yield first + i, row
    else:
        raise DataError(
            f"{path}: unsupported file type {suffix!r}; use one of {', '.join(SUFFIXES)}"
        )


def read_records(
    paths: list[str],
    per_file: Callable[[str], Callable[[object, str], Any]],
    *,
    what: str = "records",
    skip_bad: bool = False,
    stats: LoadStats | None = None,
    options: ReadOptions | None = None,
) -> list:
    """Every record of ``paths`` (in order) through a normaliser, with ``file:line`` errors.

    ``per_file(path)`` returns ``normalise(record, source)`` for that file (it may keep state, such
    as the format the file's first good record fixed); it raises :class:`DataError`. A bad
    record stops the read, or with ``skip_bad`` is counted in ``stats`` and skipped. ``options``
    (:class:`ReadOptions`): a dataset's split and subset, and the column mapping.
    """
    stats = stats if stats is not None else LoadStats()
    options = options or ReadOptions()
    out: list = []
    for path in paths:
        label, rows = source_rows(path, options)
        normalise = per_file(path)
        for lineno, record in rows:
            source = f"{label}:{lineno}"
            try:
                if isinstance(record, DataError):
                    raise record
                try:
                    record = map_columns(record, options.columns)
                except ValueError as err:
                    raise DataError(f"{source}: {err}") from None
                out.append(normalise(record, source))
                stats.records += 1
            except DataError as err:
                if not skip_bad:
                    raise
                stats.skip(err)
    if not out:
        raise DataError(f"empty dataset: no usable {what} in {', '.join(paths)}")
    return out


def source_rows(path: str, options: ReadOptions | None = None) -> tuple[str, Iterator]:
    """``(label, rows)`` of one source: a data file (``label`` = its path, rows as
    :func:`raw_records`) or a Hugging Face dataset (``label`` = ``name[split]``)."""
    options = options or ReadOptions()
    if os.path.isfile(path) and path.lower().endswith(SUFFIXES):
        return path, raw_records(path)
    if not hf_datasets.is_dataset_source(path):
        if os.path.exists(path):
            raise DataError(f"{path}: unsupported file type {os.path.splitext(path)[1]!r}; use "
                            f"one of {', '.join(SUFFIXES + ('.arrow',))} or a dataset folder")  # fmt: skip
        raise DataError(f"{path}: no such file")
    try:
        return hf_datasets.open_rows(path, options.split, options.subset, options.role)
    except hf_datasets.DatasetSourceError as err:
        raise DataError(str(err)) from None


def read_examples(
    paths: list[str],
    fmt: str = "auto",
    *,
    skip_bad: bool = False,
    stats: LoadStats | None = None,
    options: ReadOptions | None = None,
) -> list[Example]:
    """Read and normalise every record of ``paths`` (in order). Raises :class:`DataError`."""
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; choose one of {', '.join(FORMATS)}")

    def per_file(path: str):
        file_fmt = None if fmt == "auto" else fmt

        def normalise(record: object, source: str) -> Example:
            nonlocal file_fmt
            if file_fmt is None:  # the first good record fixes the format of the file
                try:
                    file_fmt = detect_format(record if isinstance(record, dict) else {})
                except ValueError as err:
                    raise DataError(f"{source}: {err}") from None
            try:
                return normalize(record, file_fmt, source)
            except ValueError as err:
                raise DataError(f"{source}: {err} (format {file_fmt})") from None

        return normalise

    return read_records(paths, per_file, skip_bad=skip_bad, stats=stats, options=options)
