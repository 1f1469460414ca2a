"""Find and load the model a post-training command works on: model and adapter resolution.

Every command (chat, infer, merge, export, serve, eval) accepts either

* ``--checkpoint PATH``: a training checkpoint / adapter directory. Its
  ``lorafuse_config.json`` names the base model (``"model"``; None = built-in default); a plain
  PEFT adapter dir falls back to ``adapter_config.json``'s ``base_model_name_or_path``. A path
  holding a ``config.json`` and no adapter (a merged model) is loaded as a model.
* ``--model`` (HF dir | .gguf file | hub id | omitted = built-in SmolLM2) plus ``--adapter PATH``.

Models load through ``load_language_model`` / ``load_vision_model`` (what
``FastLanguageModel`` / ``FastVisionModel.from_pretrained`` wrap) and adapters through
``peft.PeftModel.from_pretrained``. A checkpoint or adapter dir with a ``lorafuse_manifest.json``
(every checkpoint lorafuse writes) is checked against it first (:mod:`lorafuse.manifest`): a
truncated or altered file is one line, not a loader's traceback. Every problem is a
:class:`~lorafuse.errors.LorafuseError` naming the path.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from lorafuse import manifest
from lorafuse.errors import LorafuseError
from lorafuse.models.loaded import LoadedModel
from lorafuse.models.source import DEFAULT_GGUF, DEFAULT_MODEL, resolve_model_source
from lorafuse.patching import moe
from lorafuse.patching.report import PatchReport


@dataclass
class ModelSpec:
    """What to load: a base model source plus named adapters (name -> adapter dir)."""

    base: str | None
    adapters: dict[str, str] = field(default_factory=dict)
    load_in_4bit: bool = False
    quantize_embeddings: bool = False
    max_seq_length: int = 2048
    tokenizer_dir: str | None = None  # where the tokenizer comes from (adapter dir wins)

    @property
    def base_label(self) -> str:
        return self.base or f"{DEFAULT_MODEL} (built-in)"


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise LorafuseError(f"cannot read {path}: {err}") from err


def checkpoint_base(path: str | os.PathLike) -> tuple[str | None, dict]:
    """(base model source, training config) for an adapter/checkpoint dir ."""
    path = Path(path)
    if not path.is_dir():
        raise LorafuseError(f"checkpoint/adapter directory not found: {path}")
    cfg_file = path / "lorafuse_config.json"
    if cfg_file.is_file():
        cfg = _read_json(cfg_file)
        if "model" not in cfg:
            raise LorafuseError(
                f"{cfg_file} has no 'model' key (the base model the adapter was trained on)"
            )
        return cfg["model"], cfg
    if is_adapter_dir(path):
        base = _read_json(path / "adapter_config.json").get("base_model_name_or_path")
        return base or None, {}
    raise LorafuseError(f"{path} is neither an adapter dir (adapter_config.json) nor a checkpoint")


def resolve_spec(
    checkpoint: str | None = None,
    model: str | None = None,
    adapters: list[str] | dict[str, str] | None = None,
) -> ModelSpec:
    """Turn the CLI's --checkpoint / --model / --adapter into a ModelSpec (validating paths)."""
    named = dict(adapters) if isinstance(adapters, dict) else parse_named_adapters(adapters or [])
    for name, apath in named.items():
        if not is_adapter_dir(apath):
            raise LorafuseError(f"adapter {name!r}: {apath} has no adapter_config.json")
        manifest.verify(apath, f"--adapter {apath}")
    if checkpoint is None:
        _check_model_source(model)
        first = next(iter(named.values()), None)
        return ModelSpec(base=model, adapters=named, tokenizer_dir=_tokenizer_dir(first))
    manifest.verify(checkpoint, f"--checkpoint {checkpoint}")  # before anything reads it
    if not is_adapter_dir(checkpoint):
        if (Path(checkpoint) / "config.json").is_file():  # merged/plain HF dir given as checkpoint
            return ModelSpec(base=str(checkpoint), adapters=named)
        raise LorafuseError(
            f"--checkpoint {checkpoint}: no adapter_config.json or config.json there"
        )
    base, cfg = checkpoint_base(checkpoint)
    if model is not None:
        base = model  # explicit --model overrides the stored base (e.g. a moved model dir)
    _check_model_source(base)
    return ModelSpec(
        base=base,
        adapters={"adapter": str(checkpoint), **named},
        load_in_4bit=bool(cfg.get("load_in_4bit", False)),
        quantize_embeddings=bool(cfg.get("quantize_embeddings", False)),
        max_seq_length=int(cfg.get("max_seq_length") or 2048),
        tokenizer_dir=_tokenizer_dir(checkpoint),
    )


def parse_named_adapters(items: list[str]) -> dict[str, str]:
    """['name=path', 'path'] -> {name: path}; an unnamed path is named after its directory."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item.rstrip("/")).name or "adapter", item
        if not name or not path:
            raise LorafuseError(f"--adapter {item!r}: expected NAME=PATH")
        if name in out:
            raise LorafuseError(f"--adapter: name {name!r} given twice")
        out[name] = path
    return out


def _tokenizer_dir(path: str | None) -> str | None:
    if path and any(
        (Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return str(path)
    return None


def _check_model_source(model: str | None) -> None:
    if model is None:
        return
    p = Path(model)
    if model.endswith(".gguf") and not p.is_file():
        raise LorafuseError(f"GGUF file not found: {model}")
    if p.is_dir() and not (p / "config.json").is_file():
        raise LorafuseError(f"model directory {model} has no config.json")


def load_base(spec: ModelSpec, dtype=None, device: str | None = None) -> LoadedModel:
    """:class:`LoadedModel` ``(model, tokenizer, processor)`` of the spec's base, in eval mode.
    ``dtype=None``: the loader's choice (``models.preflight.choose_dtype``: bf16 where the device
    multiplies bf16 natively, else fp32)."""
    from lorafuse.models.fast_model import load_language_model
    from lorafuse.models.vision_processor import is_vision_model_dir

    if spec.base is not None and is_vision_model_dir(spec.base):
        return _load_vision_base(spec, dtype, device)
    try:
        model, tokenizer, _ = load_language_model(
            spec.base, max_seq_length=spec.max_seq_length, dtype=dtype,
            load_in_4bit=spec.load_in_4bit, device=device,
            quantize_embeddings=spec.quantize_embeddings,
        )  # fmt: skip
    except (OSError, ValueError) as err:  # ModelSourceError is an OSError
        raise LorafuseError(f"cannot load model {spec.base_label}: {err}") from err
    if spec.tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return LoadedModel(model, tokenizer)


def _load_vision_base(spec: ModelSpec, dtype, device) -> LoadedModel:
    """A vision-language base with its processor (the checkpoint's if it has one) and the
    processor's tokenizer."""
    from lorafuse.models.vision import load_vision_model
    from lorafuse.models.vision_processor import load_processor

    try:
        model, _, processor = load_vision_model(
            spec.base, max_seq_length=spec.max_seq_length, dtype=dtype,
            load_in_4bit=spec.load_in_4bit, device=device,
        )  # fmt: skip
        if spec.tokenizer_dir and (Path(spec.tokenizer_dir) / "processor_config.json").is_file():
            processor = load_processor(Path(spec.tokenizer_dir), spec.max_seq_length)
    except (OSError, ValueError) as err:
        raise LorafuseError(f"cannot load model {spec.base_label}: {err}") from err
    model.eval()
    return LoadedModel(model, processor.tokenizer, processor)


def load_resolved(spec: ModelSpec, dtype=None, device: str | None = None) -> LoadedModel:
    """:class:`LoadedModel` ``(model, tokenizer, processor)``: the base with every adapter of
    the spec attached (PeftModel) if any; ``processor`` is None for a text-only model.

    The first adapter is active; switch with ``model.set_adapter(name)`` and run the bare base
    under ``with model.disable_adapter():``.
    """
    loaded = load_base(spec, dtype=dtype, device=device)
    if not spec.adapters:
        return loaded
    from peft import PeftModel

    names = list(spec.adapters)
    try:
        model = PeftModel.from_pretrained(
            loaded.model, spec.adapters[names[0]], adapter_name=names[0]
        )
        for name in names[1:]:
            model.load_adapter(spec.adapters[name], adapter_name=name)
    except (ValueError, RuntimeError, KeyError) as err:
        raise LorafuseError(f"cannot attach adapter to {spec.base_label}: {err}") from err
    model.set_adapter(names[0])
    model.eval()
    moe.apply(model, None, PatchReport())  # expert LoRA: the fused op in every decoding step too
    return loaded._replace(model=model)


def resolve_hf_dir(base: str | None) -> str:
    """A local HF directory with safetensors for ``base`` (GGUF files are converted and cached)."""
    if base is not None and Path(base).is_dir():
        return str(base)
    try:
        return str(resolve_model_source(base))
    except (OSError, ValueError) as err:
        raise LorafuseError(
            f"cannot resolve base model {base or 'built-in default'}: {err}"
        ) from err


def base_model_id(spec: ModelSpec) -> str:
    """The public name of the spec's base model (file or dir name; the default's name)."""
    if spec.base is None:
        return DEFAULT_GGUF.split(".")[0]
    return Path(spec.base).name.removesuffix(".gguf")


def use_adapter(model, name: str | None):
    """A context manager that runs ``model`` with adapter ``name`` active, or the bare base (None).

    Only a PEFT model has adapters to switch: transformers 5 models carry a ``set_adapter`` of
    their own (its integration API) but no ``disable_adapter``, so asking the model is not enough.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        if name is not None:
            raise LorafuseError(f"adapter {name!r} requested but the model has no adapters loaded")
        return contextlib.nullcontext()
    if name is None:
        return model.disable_adapter()
    model.set_adapter(name)
    return contextlib.nullcontext()
