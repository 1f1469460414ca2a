"""Files in, training rows out: read, normalise, split, tokenize, mask, pack.

``build(spec, tokenizer) -> Prepared`` with ``train`` and ``eval`` row lists and counts of what was
skipped, truncated or dropped (printed by the trainer, so nothing disappears silently).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from lorafuse.data.formats import DataError, LoadStats, read_examples
from lorafuse.data.masking import Encoded, encode, ensure_chat_template
from lorafuse.data.packing import Row, pack, single_rows
from lorafuse.data.read_options import ReadOptions


@dataclass
class DataSpec:
    """The data-related subset of the training config."""

    train_files: list[str]
    eval_files: list[str] = field(default_factory=list)
    eval_split: float = 0.0
    data_format: str = "auto"
    max_seq_length: int = 2048
    train_on_inputs: bool = False
    packing: bool = True
    too_long: str = "truncate"
    skip_bad_records: bool = False
    seed: int = 3407
    data_split: str | None = None  # Hugging Face datasets: the training split (None: train)
    eval_data_split: str | None = None  # of eval_files (None: test or validation)
    data_subset: str | None = None  # a hub dataset's configuration
    data_columns: tuple[tuple[str, str], ...] = ()  # (field, column): read column as field
    think_tokens: str = "mask-empty"  # reasoning blocks in targets: see masking.THINK_TOKENS

    def read_options(self, role: str) -> ReadOptions:
        """How the ``role`` ("train" | "eval") sources are read (split, subset, columns)."""
        split = self.data_split if role == "train" else self.eval_data_split
        return ReadOptions(split, self.data_subset, tuple(self.data_columns), role)


@dataclass
class Prepared:
    train: list[Row]
    eval: list[Row]
    n_train_examples: int
    n_eval_examples: int
    stats: dict[str, int | list[str]]


def split_off_eval(examples: list, spec: DataSpec, read_eval) -> tuple[list, list]:
    """``(train, eval)``: ``read_eval(spec.eval_files)`` when given, else the first ``eval_split``
    of the (already shuffled) examples. Shared by text and image+text rows."""
    if spec.eval_files:
        return examples, read_eval(spec.eval_files)
    if spec.eval_split <= 0:
        return examples, []
    n_eval = max(1, int(round(len(examples) * spec.eval_split)))
    if n_eval >= len(examples):
        raise DataError(
            f"eval_split={spec.eval_split} leaves no training records out of {len(examples)}"
        )
    return examples[n_eval:], examples[:n_eval]


def encode_each(examples, encode_one, spec: DataSpec, counts: dict) -> list:
    """``encode_one(ex)`` for every example, counting what is skipped, dropped or truncated.

    Shared by text rows and image+text rows (``data/vision_rows.py``)."""
    out = []
    for ex in examples:
        try:
            enc = encode_one(ex)
        except DataError as err:
            if not spec.skip_bad_records or "max_seq_length" in str(err):
                raise  # too_long=error is an explicit request, never skipped
            counts["skipped"] += 1
            continue
        if enc is None:
            counts["dropped_too_long"] += 1
            continue
        counts["truncated"] += int(enc.truncated)
        if enc.n_targets == 0:  # e.g. the assistant turn was truncated away: nothing to learn
            counts["no_targets"] += 1
            continue
        out.append(enc)
    return out


def _encode_all(examples, tokenizer, spec: DataSpec, counts: dict) -> list[Encoded]:
    def one(ex):
        return encode(ex, tokenizer, spec.max_seq_length, train_on_inputs=spec.train_on_inputs,
                      too_long=spec.too_long, think_tokens=spec.think_tokens)  # fmt: skip

    return encode_each(examples, one, spec, counts)


def build(spec: DataSpec, tokenizer) -> Prepared:
    """Read ``spec.train_files`` (+ eval files or split), tokenize and (optionally) pack."""
    load = LoadStats()
    examples = read_examples(spec.train_files, spec.data_format, skip_bad=spec.skip_bad_records,
                             stats=load, options=spec.read_options("train"))  # fmt: skip
    if any(ex.messages is not None for ex in examples):
        ensure_chat_template(tokenizer)
    rng = random.Random(spec.seed)
    order = list(range(len(examples)))
    rng.shuffle(order)  # one seeded shuffle before packing; rows are reshuffled every epoch
    examples = [examples[i] for i in order]
    examples, eval_examples = split_off_eval(
        examples,
        spec,
        lambda files: read_examples(
            files,
            spec.data_format,
            skip_bad=spec.skip_bad_records,
            stats=load,
            options=spec.read_options("eval"),
        ),  # fmt: skip
    )
    counts: dict = {"skipped": 0, "truncated": 0, "dropped_too_long": 0, "no_targets": 0}
    train_enc = _encode_all(examples, tokenizer, spec, counts)
    eval_enc = _encode_all(eval_examples, tokenizer, spec, counts)
    if not train_enc:
        raise DataError(
            f"empty dataset after tokenization: {len(examples)} records read, none has a target token "
            f"left (truncated {counts['truncated']}, dropped {counts['dropped_too_long']}, "
            f"no targets {counts['no_targets']}); check max_seq_length and the record format"
        )
    if spec.packing:
        train_rows, eval_rows = (
            pack(train_enc, spec.max_seq_length),
            pack(eval_enc, spec.max_seq_length),
        )
    else:
        train_rows, eval_rows = single_rows(train_enc), single_rows(eval_enc)
    stats = {
        "records": load.records,
        "bad_records_skipped": load.skipped + counts["skipped"],
        **counts,
    }
    stats["bad_record_examples"] = load.skipped_examples
    return Prepared(train_rows, eval_rows, len(train_enc), len(eval_enc), stats)
