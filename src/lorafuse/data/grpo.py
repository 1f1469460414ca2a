"""GRPO data: prompts, plus any other columns, which the rewards receive (TRL's prompt-only format).

Records, in any file type the SFT reader takes (via :mod:`lorafuse.data.formats`):

* standard: ``{"prompt": str, ...}``: the completion continues the text (tokenized as is);
* conversational: ``prompt`` is a messages list, or a ``messages`` list: rendered with the chat
  template and its generation prompt; the last turn must not be the assistant's (the model
  writes that one).

Every other field (``answer``, ``tests``...) is a column: rewards get ``columns[name]``, one value
per completion (``None`` where a record lacks it). A prompt must leave room for the completion:
``prompt tokens + max_completion_length <= max_seq_length``; a longer one follows ``too_long``
(``truncate`` keeps the prompt's *end*, where the question and the generation prompt are;
``drop``; ``error``). Errors are ``DataError("<file>:<line>: ...")``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorafuse.data.dataset import DataSpec, Prepared
from lorafuse.data.formats import DataError, LoadStats, read_records
from lorafuse.data.masking import ensure_chat_template
from lorafuse.data.preference import chat_turns, is_chat_value, missing_fields, read_and_split
from lorafuse.data.read_options import ReadOptions
from lorafuse.generation import encode_messages, encode_prompt

PROMPT_FIELDS = ("prompt", "messages")


@dataclass
class PromptExample:
    source: str
    prompt: str | list[dict[str, str]]
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptRow:
    """One tokenized prompt; ``prompt`` and ``columns`` are what the rewards see."""

    prompt_ids: list[int]
    prompt: str | list[dict[str, str]]
    columns: dict[str, Any]
    source: str
    n_examples: int = 1

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids)


def normalize_prompt(record: object, source: str) -> PromptExample:
    """One raw record as a :class:`PromptExample`; ``ValueError`` says what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"record must be a JSON object, got {type(record).__name__}")
    present = [k for k in PROMPT_FIELDS if not missing_fields(record, k)]
    if len(present) != 1:
        raise ValueError("a GRPO record needs exactly one of 'prompt' (text or messages) or "
                         f"'messages', got {present or 'neither'}")  # fmt: skip
    key = present[0]
    value = record[key]
    if key == "messages" or is_chat_value(value):
        prompt = chat_turns(value, key)
        if not prompt:
            raise ValueError(f"{key!r} is empty")
        if prompt[-1]["role"] == "assistant":
            raise ValueError(f"the last turn of {key!r} is the assistant's; the model writes it "
                             "(end the prompt with the user turn)")  # fmt: skip
    elif isinstance(value, str):
        if not value.strip():
            raise ValueError("empty prompt")
        prompt = value
    else:
        raise ValueError(f"field {key!r} must be a string or a messages list, "
                         f"got {type(value).__name__}")  # fmt: skip
    columns = {k: v for k, v in record.items() if k != key}
    return PromptExample(source, prompt, columns)


def read_prompts(paths: list[str], *, skip_bad: bool = False, stats: LoadStats | None = None,
                 options: ReadOptions | None = None):  # fmt: skip
    """Every prompt record of ``paths`` in order; ``DataError("file:line: ...")`` when malformed."""

    def normalise(record: object, source: str) -> PromptExample:
        try:
            return normalize_prompt(record, source)
        except ValueError as err:
            raise DataError(f"{source}: {err} (GRPO prompt record)") from None

    return read_records(paths, lambda path: normalise, what="GRPO prompt records",
                        skip_bad=skip_bad, stats=stats, options=options)  # fmt: skip


def encode_prompt_ids(tokenizer, prompt) -> list[int]:
    """Token ids of a text prompt as the tokenizer gives them, or of a chat through the template
    with the generation prompt (what the model continues), as ``chat`` encodes them."""
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt)
    return encode_messages(tokenizer, prompt)


def _encode(examples, tokenizer, budget: int, too_long: str, counts: dict) -> list[PromptRow]:
    out = []
    for ex in examples:
        try:
            ids = encode_prompt_ids(tokenizer, ex.prompt)
        except Exception as err:  # jinja errors: roles the template rejects, etc.
            raise DataError(
                f"{ex.source}: the chat template failed on this record ({err})"
            ) from None
        if len(ids) > budget:
            if too_long == "error":
                raise DataError(
                    f"{ex.source}: prompt is {len(ids)} tokens; with max_completion_length the row "
                    f"allows {budget} (use too_long=truncate or drop, or raise max_seq_length)"
                )
            if too_long == "drop":
                counts["dropped_too_long"] += 1
                continue
            ids = ids[len(ids) - budget :]  # keep the end: the question and generation prompt
            counts["truncated"] += 1
        out.append(PromptRow(ids, ex.prompt, ex.columns, ex.source))
    return out


def build_prompts(spec: DataSpec, tokenizer, max_completion_length: int) -> Prepared:
    """Read, split and tokenize GRPO prompt files; ``Prepared`` whose rows are :class:`PromptRow`."""
    budget = spec.max_seq_length - max_completion_length
    if budget < 1:
        raise DataError(f"max_seq_length={spec.max_seq_length} leaves no room for a prompt with "
                        f"max_completion_length={max_completion_length}")  # fmt: skip
    load = LoadStats()
    examples, eval_examples = read_and_split(spec, read_prompts, load, "prompts")
    if any(not isinstance(ex.prompt, str) for ex in examples + eval_examples):
        ensure_chat_template(tokenizer)
    counts = {"truncated": 0, "dropped_too_long": 0}
    train = _encode(examples, tokenizer, budget, spec.too_long, counts)
    evals = _encode(eval_examples, tokenizer, budget, spec.too_long, counts)
    if not train:
        raise DataError(f"no GRPO prompt left: {len(examples)} read, dropped "
                        f"{counts['dropped_too_long']} longer than {budget} tokens")  # fmt: skip
    stats = {"records": load.records, "bad_records_skipped": load.skipped, "no_targets": 0,
             "bad_record_examples": load.skipped_examples, **counts}  # fmt: skip
    return Prepared(train, evals, len(train), len(evals), stats)


def columns_of(rows: list[PromptRow], n: int) -> dict[str, list]:
    """Every column of ``rows`` as lists, each row's value repeated ``n`` times (one per
    completion; ``None`` where a row lacks the column)."""
    names = sorted({k for r in rows for k in r.columns})
    return {k: [r.columns.get(k) for r in rows for _ in range(n)] for k in names}
