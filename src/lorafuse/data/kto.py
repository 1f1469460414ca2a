"""KTO data: unpaired completions, each marked desirable or not (TRL's unpaired preference format).

Records, in any file type the SFT reader takes (via :mod:`lorafuse.data.formats`):

* standard: ``{"prompt": str, "completion": str, "label": bool}``; the completion follows the
  prompt directly and gets the tokenizer's EOS (as a prompt/completion SFT record);
* conversational: ``prompt`` and ``completion`` are ``messages`` lists, or one ``messages`` list
  whose last turn (an assistant turn) is the completion. Rendered with the chat template.

``label`` is a JSON boolean (CSV cells ``true``/``false``; 0/1 is refused: a typo of a score
should not pass for a label). Tokenization, masking and ``too_long`` are the preference pairs'
(:func:`lorafuse.data.preference.encode_response`); errors are ``DataError("<file>:<line>: ...")``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafuse.data.dataset import DataSpec, Prepared
from lorafuse.data.formats import DataError, LoadStats, read_records
from lorafuse.data.masking import IGNORE_INDEX, Encoded, ensure_chat_template
from lorafuse.data.preference import (
    PreferenceExample,
    chat_turns,
    encode_response,
    is_chat_value,
    missing_fields,
    read_and_split,
)
from lorafuse.data.read_options import ReadOptions


@dataclass
class KTOExample:
    source: str
    prompt: str | list[dict[str, str]]
    completion: str | list[dict[str, str]]
    label: bool


@dataclass
class KTORow:
    """One tokenized completion: ``input_ids[:prompt_len]`` is the prompt, the rest the completion."""

    enc: Encoded
    label: bool
    prompt_len: int
    n_examples: int = 1  # 0 for the padding rows of uneven distributed shards

    @property
    def n_targets(self) -> int:
        return self.enc.n_targets

    @property
    def n_tokens(self) -> int:
        return len(self.enc.input_ids)

    def zeroed(self) -> KTORow:
        blank = Encoded(self.enc.input_ids, [IGNORE_INDEX] * len(self.enc.labels))
        return KTORow(blank, self.label, self.prompt_len, 0)


def _label(value) -> bool:
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # numpy bool_ from Parquet
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"  # CSV cells
    raise ValueError(f"field 'label' must be a boolean (true = desirable), got {value!r}")


def normalize_kto(record: object, source: str) -> KTOExample:
    """One raw record as a :class:`KTOExample`; ``ValueError`` says what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"record must be a JSON object, got {type(record).__name__}")
    if missing_fields(record, "label"):
        raise ValueError("missing field 'label' (KTO records need a boolean label)")
    label = _label(record["label"])
    if not missing_fields(record, "messages"):
        turns = chat_turns(record["messages"], "messages")
        if not turns or turns[-1]["role"] != "assistant":
            raise ValueError("the last turn of 'messages' must be the assistant's completion")
        prompt, completion = turns[:-1], turns[-1:]
    else:
        for key in ("prompt", "completion"):
            if missing_fields(record, key):
                raise ValueError(f"missing field {key!r} (or give 'messages')")
        if is_chat_value(record["completion"]):
            prompt = chat_turns(record["prompt"], "prompt")
            completion = chat_turns(record["completion"], "completion")
            if not any(t["role"] == "assistant" for t in completion):
                raise ValueError("completion has no assistant turn, so nothing to score")
        else:
            prompt, completion = record["prompt"], record["completion"]
            for key, v in (("prompt", prompt), ("completion", completion)):
                if not isinstance(v, str):
                    raise ValueError(f"field {key!r} must be a string (or both messages lists), "
                                     f"got {type(v).__name__}")  # fmt: skip
    text = (
        completion
        if isinstance(completion, str)
        else "".join(t["content"] for t in completion if t["role"] == "assistant")
    )
    if not text.strip():
        raise ValueError("empty completion")
    return KTOExample(source, prompt, completion, label)


def read_kto(paths: list[str], *, skip_bad: bool = False, stats: LoadStats | None = None,
             options: ReadOptions | None = None):  # fmt: skip
    """Every KTO record of ``paths`` in order; ``DataError("file:line: ...")`` when malformed."""

    def normalise(record: object, source: str) -> KTOExample:
        try:
            return normalize_kto(record, source)
        except ValueError as err:
            raise DataError(f"{source}: {err} (KTO record)") from None

    return read_records(paths, lambda path: normalise, what="KTO records", skip_bad=skip_bad,
                        stats=stats, options=options)  # fmt: skip


def _encode(examples, tokenizer, spec: DataSpec, counts: dict) -> list[KTORow]:
    out = []
    for ex in examples:
        as_pair = PreferenceExample(ex.source, ex.prompt, ex.completion, ex.completion)
        enc = encode_response(as_pair, ex.completion, tokenizer, spec.max_seq_length,
                              spec.too_long, spec.think_tokens)  # fmt: skip
        if enc is None:
            counts["dropped_too_long"] += 1
            continue
        counts["truncated"] += int(enc.truncated)
        if enc.n_targets == 0:  # the completion was truncated away
            counts["no_targets"] += 1
            continue
        first = next(i for i, t in enumerate(enc.labels) if t != IGNORE_INDEX)
        out.append(KTORow(enc, ex.label, first))
    return out


def build_kto(spec: DataSpec, tokenizer) -> Prepared:
    """Read, split and tokenize KTO files; ``Prepared`` whose rows are :class:`KTORow`.

    Stats as :func:`lorafuse.data.preference.build_pairs`, plus ``desirable`` / ``undesirable``.
    """
    load = LoadStats()
    examples, eval_examples = read_and_split(spec, read_kto, load, "records")
    if any(not isinstance(ex.prompt, str) for ex in examples + eval_examples):
        ensure_chat_template(tokenizer)
    counts = {"skipped": 0, "truncated": 0, "dropped_too_long": 0, "no_targets": 0}
    train = _encode(examples, tokenizer, spec, counts)
    evals = _encode(eval_examples, tokenizer, spec, counts)
    if not train:
        raise DataError(
            f"no KTO record left after tokenization: {len(examples)} read, truncated "
            f"{counts['truncated']}, dropped {counts['dropped_too_long']}, no completion tokens "
            f"left {counts['no_targets']}; check max_seq_length"
        )
    stats = {"records": load.records, "bad_records_skipped": load.skipped, **counts}
    stats["bad_record_examples"] = load.skipped_examples
    stats["desirable"] = sum(r.label for r in train)
    stats["undesirable"] = len(train) - stats["desirable"]
    return Prepared(train, evals, len(train), len(evals), stats)
