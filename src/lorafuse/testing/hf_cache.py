"""Hugging Face datasets made locally for tests: a hub dataset as the local cache holds it after a
``load_dataset("org/name", subset)`` (``<cache>/org___name/<subset>/0.0.0/<hash>/``, one ``.arrow``
file per split and ``dataset_info.json``), written by ``datasets``' own JSON builder from records
given here, so ``load_dataset`` reads it back offline exactly as it reads a downloaded one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path


def cache_hub_dataset(
    cache_dir: str | Path, repo_id: str, splits: dict[str, list[dict]], subset: str = "default"
) -> Path:
    """Write ``splits`` ({split: records}) as the cached hub dataset ``repo_id`` (``org/name``)
    configuration ``subset`` under ``cache_dir``; returns the cached folder."""
    from datasets.packaged_modules.json.json import Json

    namespace, _, name = repo_id.rpartition("/")
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, records in splits.items():
            files[split] = str(Path(tmp) / f"{split}.jsonl")
            Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in records))
        # The builder names files and folders after dataset_name; the hub's namespace folder
        # (``org___``) is what a hub download adds, and local files cannot carry a repo_id.
        builder = Json(cache_dir=str(Path(tmp) / "build"), dataset_name=name, config_name=subset,
                       config_id=subset, hash="local", data_files=files)  # fmt: skip
        builder.download_and_prepare()
        built = Path(tmp) / "build" / name / subset
        target = Path(cache_dir) / (f"{namespace}___{name}" if namespace else name) / subset
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(built, target, dirs_exist_ok=True)
    return target
