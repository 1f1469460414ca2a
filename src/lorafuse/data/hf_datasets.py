"""Hugging Face datasets as data sources, read by the ``datasets`` library, offline.

A source that is not a ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file is one of:

* an ``.arrow`` file (``Dataset.from_file``: one table, no splits);
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``load_from_disk``);
* a hub id (``name`` or ``org/name``) that is no local path: ``load_dataset(id, subset)`` from the
  local datasets cache only (``$HF_DATASETS_CACHE``, else ``$HF_HOME/datasets``, else
  ``~/.cache/huggingface/datasets``), with the hub unreachable by design: ``datasets``' offline
  mode is switched on for the call (and restored after), so nothing is downloaded and a dataset
  that is not cached is one line that says so.

:func:`open_rows` picks the split (the asked one; else ``train`` for training data and ``test`` or
``validation`` for evaluation data; else the only one) and yields ``(row number, record dict)``
from 1, as the file readers yield ``(line, record)``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from lorafuse.errors import LorafuseError

INSTALL = "pip install datasets (lorafuse's `data` extra: pip install 'lorafuse[data]')"
DEFAULT_SPLITS = {"train": ("train",), "eval": ("test", "validation", "valid", "eval", "dev")}
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")  # the file readers' (formats.SUFFIXES)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # save_to_disk writes one of them


class DatasetSourceError(LorafuseError, ValueError):
    """A dataset source that cannot be read: not cached, no such split or subset, no ``datasets``."""


def is_dataset_source(path: str) -> bool:
    """Whether ``path`` names an ``.arrow`` file, a folder or a hub id (not a data file)."""
    if path.lower().endswith(".arrow") or os.path.isdir(path):
        return True
    return is_hub_id(path)


def is_hub_id(path: str) -> bool:
    """``name`` or ``org/name``, with no such local path and no data-file suffix."""
    return (
        not os.path.exists(path)
        and HUB_ID.fullmatch(path) is not None
        and not path.lower().endswith(FILE_SUFFIXES)
    )


def cache_dir() -> str:
    """The datasets cache a hub id is read from (as ``datasets.config`` derives it)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "datasets")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DatasetSourceError(
            f"reading a Hugging Face dataset needs `datasets`: {INSTALL}"
        ) from None
    return datasets


@contextlib.contextmanager
def _offline(datasets):
    """``datasets``' offline mode (``HF_DATASETS_OFFLINE=1``) for one call: its module flag is read
    at call time (the environment variable only at import), so it is set and restored here; its
    warnings that the hub "couldn't be reached" are quiet meanwhile (offline is the point)."""
    before, verbosity = datasets.config.HF_HUB_OFFLINE, datasets.logging.get_verbosity()
    datasets.config.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before
        datasets.logging.set_verbosity(verbosity)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def load(path: str, subset: str | None):
    """The ``Dataset`` or ``DatasetDict`` that ``path`` names (see the module docstring)."""
    datasets = _datasets()
    if path.lower().endswith(".arrow"):
        if subset:
            raise DatasetSourceError(f"{path}: an .arrow file has no subsets (drop --data-subset)")
        if not os.path.isfile(path):
            raise DatasetSourceError(f"{path}: no such file")
        try:
            return datasets.Dataset.from_file(path)
        except Exception as err:  # pyarrow errors: not an Arrow stream file
            raise DatasetSourceError(
                f"{path}: not a readable Arrow file ({_one_line(err)})"
            ) from None
    if os.path.isdir(path):
        if subset:
            raise DatasetSourceError(f"{path}: a saved dataset folder has no subsets "
                                     "(drop --data-subset)")  # fmt: skip
        if not any((Path(path) / m).is_file() for m in SAVED_MARKERS):
            raise DatasetSourceError(
                f"{path}: a folder, but not one written by save_to_disk (no "
                f"{' or '.join(SAVED_MARKERS)}); give its data files or .arrow files instead"
            )
        return datasets.load_from_disk(path)
    cache = cache_dir()
    try:
        with _offline(datasets):
            return datasets.load_dataset(path, subset, cache_dir=cache)
    except ConnectionError:  # offline and not in the cache
        raise DatasetSourceError(
            f"{path}: no such file, and no dataset {path!r} in the local Hugging Face datasets "
            f"cache ({cache}); lorafuse reads hub datasets offline: load it once with "
            "datasets.load_dataset where the hub is reachable (or save_to_disk and give the folder)"
        ) from None
    except ValueError as err:  # several cached subsets and none named, or an unknown one
        raise DatasetSourceError(f"{path}: {_one_line(err)} (--data-subset)") from None


def choose_split(names: list[str], asked: str | None, role: str, label: str) -> str:
    """The split to read: ``asked``, else the role's default that exists, else the only one."""
    if asked is not None:
        if asked not in names:
            raise DatasetSourceError(f"{label}: no split {asked!r}; it has {', '.join(names)}")
        return asked
    for name in DEFAULT_SPLITS[role]:
        if name in names:
            return name
    if len(names) == 1 and (role == "train" or names[0] != "train"):
        return names[0]
    if names == ["train"]:  # never evaluate on the training split unasked
        raise DatasetSourceError(f"{label}: only a train split; name it to evaluate on it "
                                 "(--eval-data-split train; lorafuse eval: --data-split train)")  # fmt: skip
    flag = "--data-split" if role == "train" else "--eval-data-split (lorafuse eval: --data-split)"
    raise DatasetSourceError(f"{label}: splits {', '.join(names)}; name one with {flag}")


def open_rows(
    path: str, split: str | None, subset: str | None, role: str = "train"
) -> tuple[str, Iterator[tuple[int, dict]]]:
    """``(label, rows)``: ``label`` names the source in messages (``org/name[train]``), ``rows``
    yields ``(row number from 1, record)``. ``role`` ("train" | "eval") picks the default split."""
    data = load(path, subset)
    if hasattr(data, "keys"):  # a DatasetDict
        chosen = choose_split(list(data.keys()), split, role, path)
        data, label = data[chosen], f"{path}[{chosen}]"
    elif split is not None and split != str(data.split):
        raise DatasetSourceError(f"{path}: one table with no splits (drop --data-split {split})")
    else:
        label = path
    return label, enumerate(iter(data), 1)
