"""How sources are read beyond their record format: a Hugging Face dataset's split and subset,
and a column mapping (``--data-columns prompt=question``) applied to every record of every
source before its format is read. Used by :func:`lorafuse.data.formats.read_records`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadOptions:
    """How sources are read beyond their format: a Hugging Face dataset's ``split`` (None: its
    ``role``'s default, see :func:`hf_datasets.choose_split`) and ``subset`` (a hub dataset's
    configuration), and ``columns``: ``((field, column), ...)``, each record's ``column`` read
    as ``field`` (any source; the column must be in every record)."""

    split: str | None = None
    subset: str | None = None
    columns: tuple[tuple[str, str], ...] = ()
    role: str = "train"  # "train" | "eval": which split a dataset gives by default


def parse_columns(items) -> tuple[tuple[str, str], ...]:
    """``["prompt=question,completion=answer"]`` (or a ``{field: column}`` mapping) ->
    ``(("prompt", "question"), ("completion", "answer"))``; ``ValueError`` names a bad item."""
    if isinstance(items, dict):
        items = [f"{k}={v}" for k, v in items.items()]
    pairs: list[tuple[str, str]] = []
    for item in (p for entry in items for p in str(entry).split(",") if p.strip()):
        field_name, sep, column = (x.strip() for x in item.partition("="))
        if not sep or not field_name or not column:
            raise ValueError(f"{item!r} is not field=column (e.g. prompt=question)")
        if field_name in (f for f, _ in pairs):
            raise ValueError(f"field {field_name!r} is mapped twice")
        pairs.append((field_name, column))
    return tuple(pairs)


def map_columns(record: object, columns: tuple[tuple[str, str], ...]) -> object:
    """``record`` with each mapped ``column`` renamed to its ``field`` (a record's own column of
    that field's name is replaced); ``ValueError`` when a mapped column is missing."""
    if not columns or not isinstance(record, dict):
        return record
    missing = [c for _, c in columns if c not in record]
    if missing:
        raise ValueError(f"no column {', '.join(map(repr, missing))} (--data-columns); the "
                         f"record has {sorted(record)}")  # fmt: skip
    renamed = {c for _, c in columns}
    out = {k: v for k, v in record.items() if k not in renamed}
    out.update({f: record[c] for f, c in columns})
    return out
