"""Preference pairs (DPO, ORPO, SimPO, CPO, reward models): files in, tokenized (chosen, rejected) pairs out.

Records (TRL's preference formats), in any file type the SFT reader takes (``.jsonl`` ``.json``
``.csv`` ``.parquet``, via :mod:`lorafuse.data.formats`):

* standard: ``{"prompt": str, "chosen": str, "rejected": str}``: raw text, the response follows
  the prompt directly and gets the tokenizer's EOS, exactly as a prompt/completion SFT record;
* conversational: ``chosen``/``rejected`` are OpenAI ``messages`` lists (usually one assistant
  turn) and ``prompt`` is a messages list too; or no ``prompt`` and two full conversations that
  share every turn but the last (TRL's implicit prompt). Rendered with the chat template.

Either may carry a numeric ``margin`` (TRL's reward-model margin: how much the chosen response
beats the rejected one); only ``rm`` reads it.

Masking follows :mod:`lorafuse.data.masking`: only the response tokens are targets (the
assistant turns *of the response*, not any assistant turn inside a multi-turn prompt), and the
first token never is. Truncation follows ``too_long`` per sequence (truncate keeps the start, as
TRL's default); a pair whose chosen or rejected response is truncated away is dropped and
counted. Errors are ``DataError("<file>:<line>: ...")`` (missing field, empty response, bad
turns); a pair whose chosen equals its rejected is kept and counted in ``identical_pairs``
(the trainer prints a warning: such a pair has no preference signal, its DPO gradient is 0).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lorafuse.data.dataset import DataSpec, Prepared
from lorafuse.data.formats import (
    ROLES,
    DataError,
    LoadStats,
    as_list,
    read_records,
    with_reasoning,
)
from lorafuse.data.masking import (
    IGNORE_INDEX,
    Encoded,
    chat_segments,
    ensure_chat_template,
    tokenize_with_spans,
)
from lorafuse.data.read_options import ReadOptions


@dataclass
class PreferenceExample:
    """One pair; text (``prompt`` str, responses str) or chat (every field a messages list)."""

    source: str
    prompt: str | list[dict[str, str]]
    chosen: str | list[dict[str, str]]
    rejected: str | list[dict[str, str]]
    margin: float | None = None  # optional: how much chosen beats rejected (reward models)

    @property
    def is_chat(self) -> bool:
        return isinstance(self.chosen, list)


@dataclass
class PairRow:
    """A tokenized pair: one training "row" (chosen and rejected run in the same batch)."""

    chosen: Encoded
    rejected: Encoded
    n_examples: int = 1  # 0 for the padding pairs of uneven distributed shards
    margin: float | None = None  # the record's optional margin (rm: TRL's RewardTrainer margin)

    @property
    def n_targets(self) -> int:
        return self.chosen.n_targets + self.rejected.n_targets

    @property
    def n_tokens(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)

    def zeroed(self) -> PairRow:
        """A padding pair with no targets and zero weight."""
        blank = lambda e: Encoded(e.input_ids, [IGNORE_INDEX] * len(e.labels))  # noqa: E731
        return PairRow(blank(self.chosen), blank(self.rejected), 0, self.margin)


# ---- records ---------------------------------------------------------------------------------
def chat_turns(value, key: str) -> list[dict[str, str]]:
    value = as_list(value, key)  # JSON text in CSV / Parquet cells, numpy arrays: a list
    out = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise ValueError(f"{key}[{i}] must be an object with 'role' and 'content'")
        if turn["role"] not in ROLES or not isinstance(turn["content"], str):
            raise ValueError(f"{key}[{i}]: role must be one of {ROLES} and content a string")
        out.append(with_reasoning({"role": turn["role"], "content": turn["content"]}, turn,
                                  f"{key}[{i}]"))  # fmt: skip
    return out


def is_chat_value(value) -> bool:
    if isinstance(value, str):
        return value.lstrip().startswith("[")  # a messages list stored as JSON text (CSV)
    return isinstance(value, list) or hasattr(value, "tolist")


def missing_fields(record: dict, key: str) -> bool:
    v = record.get(key)
    return v is None or (isinstance(v, float) and v != v)  # absent, null or NaN (pandas)


def record_margin(record: dict) -> float | None:
    """The record's optional numeric ``margin`` (None when absent)."""
    if missing_fields(record, "margin"):
        return None
    value = record["margin"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field 'margin' must be a number, got {type(value).__name__}")
    return float(value)


def normalize_pair(record: object, source: str) -> PreferenceExample:
    """One raw record as a :class:`PreferenceExample`; ``ValueError`` says what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"record must be a JSON object, got {type(record).__name__}")
    margin = record_margin(record)
    for key in ("chosen", "rejected"):
        if missing_fields(record, key):
            raise ValueError(f"missing field {key!r} (preference records need chosen and rejected)")
    if is_chat_value(record["chosen"]):
        chosen, rejected = (
            chat_turns(record["chosen"], "chosen"),
            chat_turns(record["rejected"], "rejected"),
        )
        if missing_fields(
            record, "prompt"
        ):  # implicit prompt: the shared turns before the last one
            if chosen[:-1] != rejected[:-1] or len(chosen) < 2:
                raise ValueError("no 'prompt' field, and chosen/rejected do not share all turns "
                                 "but the last (give the prompt explicitly)")  # fmt: skip
            prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
        else:
            prompt = chat_turns(record["prompt"], "prompt")
        for key, turns in (("chosen", chosen), ("rejected", rejected)):
            if not any(t["role"] == "assistant" for t in turns):
                raise ValueError(f"{key} has no assistant turn, so nothing to score")
            if not "".join(t["content"] for t in turns if t["role"] == "assistant").strip():
                raise ValueError(f"empty response in {key!r}")
        return PreferenceExample(source, prompt, chosen, rejected, margin)
    values = {}
    for key in ("prompt", "chosen", "rejected"):
        if missing_fields(record, key):
            raise ValueError(f"missing field {key!r}")
        if not isinstance(record[key], str):
            raise ValueError(f"field {key!r} must be a string (or all three messages lists), "
                             f"got {type(record[key]).__name__}")  # fmt: skip
        values[key] = record[key]
    for key in ("chosen", "rejected"):
        if not values[key].strip():
            raise ValueError(f"empty response in {key!r}")
    return PreferenceExample(source, values["prompt"], values["chosen"], values["rejected"], margin)


def read_pairs(paths: list[str], *, skip_bad: bool = False, stats: LoadStats | None = None,
               options: ReadOptions | None = None):  # fmt: skip
    """Every pair of ``paths`` in order; ``DataError("file:line: ...")`` for malformed records."""

    def normalise(record: object, source: str) -> PreferenceExample:
        try:
            return normalize_pair(record, source)
        except ValueError as err:
            raise DataError(f"{source}: {err} (preference record)") from None

    return read_records(paths, lambda path: normalise, what="preference records",
                        skip_bad=skip_bad, stats=stats, options=options)  # fmt: skip


# ---- tokens ----------------------------------------------------------------------------------
def _fit(ids, labels, source, max_len: int, too_long: str) -> Encoded | None:
    if labels:
        labels[0] = IGNORE_INDEX
    if len(ids) <= max_len:
        return Encoded(ids, labels)
    if too_long == "error":
        raise DataError(f"{source}: sequence is {len(ids)} tokens, longer than max_seq_length="
                        f"{max_len} (use too_long=truncate or drop, or raise max_seq_length)")  # fmt: skip
    if too_long == "drop":
        return None
    return Encoded(ids[:max_len], labels[:max_len], truncated=True)


def encode_response(ex: PreferenceExample, response, tokenizer, max_len: int, too_long: str,
                    think_tokens: str = "mask-empty"):  # fmt: skip
    """``prompt + response`` tokenized, targets on the response only (None if dropped); reasoning
    blocks as ``think_tokens`` says (:mod:`lorafuse.data.masking`)."""
    if ex.is_chat:
        messages = list(ex.prompt) + list(response)
        try:
            text, turns = chat_segments(tokenizer, messages, think_tokens)
        except Exception as err:  # jinja errors: roles the template rejects, etc.
            raise DataError(
                f"{ex.source}: the chat template failed on this record ({err})"
            ) from None
        n_prompt_turns = sum(1 for m in ex.prompt if m["role"] == "assistant")
        spans = [span for turn in turns[n_prompt_turns:] for span in turn]
        ids, inside = tokenize_with_spans(tokenizer, text, spans, False)
    else:
        text = ex.prompt + response
        ids, inside = tokenize_with_spans(tokenizer, text, [(len(ex.prompt), len(text))], True)
        if tokenizer.eos_token_id is not None:  # as SFT's prompt/completion: learn to stop
            ids.append(tokenizer.eos_token_id)
            inside.append(True)
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids, inside)]
    return _fit(ids, labels, ex.source, max_len, too_long)


def _encode_pairs(examples, tokenizer, spec: DataSpec, counts: dict) -> list[PairRow]:
    out = []
    for ex in examples:
        if ex.chosen == ex.rejected:
            counts["identical_pairs"] += 1
        enc = [encode_response(ex, r, tokenizer, spec.max_seq_length, spec.too_long,
                               spec.think_tokens) for r in (ex.chosen, ex.rejected)]  # fmt: skip
        if any(e is None for e in enc):
            counts["dropped_too_long"] += 1
            continue
        counts["truncated"] += int(enc[0].truncated or enc[1].truncated)
        if enc[0].n_targets == 0 or enc[1].n_targets == 0:  # a response truncated away
            counts["no_targets"] += 1
            continue
        out.append(PairRow(enc[0], enc[1], margin=ex.margin))
    return out


def read_and_split(spec: DataSpec, read, load: LoadStats, what: str) -> tuple[list, list]:
    """``(train, eval)`` records: ``read(files, skip_bad=, stats=, options=)`` over the train
    files, shuffled by ``spec.seed``, eval from its own files or the first ``eval_split`` of them."""
    examples = read(spec.train_files, skip_bad=spec.skip_bad_records, stats=load,
                    options=spec.read_options("train"))  # fmt: skip
    random.Random(spec.seed).shuffle(examples)
    if spec.eval_files:
        return examples, read(spec.eval_files, skip_bad=spec.skip_bad_records, stats=load,
                              options=spec.read_options("eval"))  # fmt: skip
    if spec.eval_split <= 0:
        return examples, []
    n_eval = max(1, int(round(len(examples) * spec.eval_split)))
    if n_eval >= len(examples):
        raise DataError(
            f"eval_split={spec.eval_split} leaves no training {what} out of {len(examples)}"
        )
    return examples[n_eval:], examples[:n_eval]


def build_pairs(spec: DataSpec, tokenizer) -> Prepared:
    """Read, split and tokenize preference files; ``Prepared`` whose rows are :class:`PairRow`.

    ``spec.packing`` and ``spec.train_on_inputs`` do not apply (one pair a row; targets are the
    responses by definition). Counts as :func:`lorafuse.data.dataset.build`, plus
    ``identical_pairs``.
    """
    load = LoadStats()
    examples, eval_examples = read_and_split(spec, read_pairs, load, "pairs")
    if any(ex.is_chat for ex in examples + eval_examples):
        ensure_chat_template(tokenizer)
    counts = {"skipped": 0, "truncated": 0, "dropped_too_long": 0, "no_targets": 0,
              "identical_pairs": 0}  # fmt: skip
    train = _encode_pairs(examples, tokenizer, spec, counts)
    evals = _encode_pairs(eval_examples, tokenizer, spec, counts)
    if not train:
        raise DataError(
            f"no preference pair left after tokenization: {len(examples)} read, truncated "
            f"{counts['truncated']}, dropped {counts['dropped_too_long']}, no response tokens left "
            f"{counts['no_targets']}; check max_seq_length"
        )
    stats = {"records": load.records, "bad_records_skipped": load.skipped, **counts}
    stats["bad_record_examples"] = load.skipped_examples
    return Prepared(train, evals, len(train), len(evals), stats)
