"""The training form: schema from :class:`TrainConfig`, validation with its own messages, CLI/YAML.

``TrainConfig`` is the single source of truth: the schema lists its dataclass fields (type from the
annotation, default, ``help`` metadata), and validation builds a ``TrainConfig`` so its
``ConfigError`` messages reach the page unchanged. The UI adds only what a web form needs:
JSON values coerced to the field types (a form sends ``"16"``), paths kept inside the workspace,
and the fields the UI owns (``output_dir`` = ``<run dir>/out``, ``resume``, ``overwrite``) left out.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

from lorafuse.data import hf_datasets
from lorafuse.data.formats import FORMATS
from lorafuse.data.masking import THINK_TOKENS, TOO_LONG
from lorafuse.data.read_options import ReadOptions, parse_columns
from lorafuse.train.config import (
    DPO_LOSS_TYPES,
    GRPO_LOSS_TYPES,
    INITS,
    KL_ESTIMATORS,
    METHODS,
    REWARD_SCALES,
    ConfigError,
    TrainConfig,
)
from lorafuse.ui.errors import BadRequest, UIError
from lorafuse.ui.security import resolve_in

UI_OWNED = ("output_dir", "resume", "overwrite")  # set by the run manager, never by the page
PATH_FIELDS = ("data", "eval_data", "init_adapter")  # always workspace paths
# Choices of the str fields TrainConfig checks against a fixed set (tests/ui/test_form.py checks
# that TrainConfig accepts each one and refuses anything else, so this cannot drift).
CHOICES: dict[str, list] = {
    "dtype": [None, "float32", "bfloat16", "float16"],
    "data_format": list(FORMATS),
    "too_long": list(TOO_LONG),
    "think_tokens": list(THINK_TOKENS),
    "lr_scheduler": ["cosine", "linear", "constant"],
    "optimizer": ["adamw", "adamw_8bit"],
    "strategy": ["auto", "ddp", "fsdp", "none"],
    "method": list(METHODS),
    "loss_type": [None, *DPO_LOSS_TYPES, *GRPO_LOSS_TYPES],  # None: the method's default
    "scale_rewards": list(REWARD_SCALES),
    "kl_estimator": list(KL_ESTIMATORS),
    # LoRA init; pissa_niter_N (PiSSA by fast SVD) stays a CLI / YAML value
    "init_lora_weights": list(INITS),
}
# What a choice needs next to it to be valid (grpo, rloo and ppo need a reward; grpo's losses need
# it).
_GRPO = {"method": "grpo", "reward": ["exact"]}
CHOICE_CONTEXT: dict[tuple[str, Any], dict] = {
    ("method", "grpo"): _GRPO,
    ("method", "rloo"): {"method": "rloo", "reward": ["exact"]},
    ("method", "ppo"): {"method": "ppo", "reward": ["exact"]},
    **{("loss_type", t): _GRPO for t in GRPO_LOSS_TYPES},
}
# The first field of each group, in TrainConfig's field order (later fields inherit the group).
GROUP_STARTS = {
    "model": "model",
    "lora_r": "lora",
    "data": "data",
    "epochs": "optimisation",
    "output_dir": "run",
    "method": "optimisation",  # the method (sft, dpo, ..., ppo) and each one's settings
}
_FIELD_IN_MESSAGE = re.compile(r"^(?:[^:]*: )?([a-z_0-9]+)=")


def field_type(annotation: Any) -> str:
    """``"int | None"`` -> ``"int"``; ``"list[str] | None"`` -> ``"list[str]"``."""
    return str(annotation).replace(" | None", "").replace("None | ", "").strip()


def schema() -> dict:
    """``{fields: [{name, type, default, help, choices, group}]}`` for every page-settable field."""
    defaults = TrainConfig()
    group = "model"
    fields = []
    for f in dataclasses.fields(TrainConfig):
        group = GROUP_STARTS.get(f.name, group)
        if f.name in UI_OWNED:
            continue
        fields.append(
            {
                "name": f.name,
                "type": field_type(f.type),
                # None stays None: beta / loss_type resolve per method in TrainConfig
                "default": None if f.default is None else getattr(defaults, f.name),
                "help": f.metadata["help"],
                "choices": CHOICES.get(f.name),
                "group": group,
                "nullable": "None" in str(f.type),
            }
        )
    return {"fields": fields}


def _coerce(name: str, kind: str, value: Any, nullable: bool) -> Any:
    """A JSON/form value as the field's Python type; ``ValueError`` with a message otherwise."""
    if value is None or (isinstance(value, str) and not value.strip() and kind != "str"):
        if nullable or kind.startswith("list["):
            return None if nullable else []
        raise ValueError("a value is required")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError("must be true or false")
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("must be a whole number")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError("must be a whole number") from None
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError("must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError("must be a number") from None
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError("must be text")
        return value if value.strip() or not nullable else None
    if kind.startswith("list["):
        elem = kind[5:-1]
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ValueError("must be a list")
        return [_coerce(name, elem, v, False) for v in items]
    raise ValueError(f"unsupported field type {kind}")


def _message_field(message: str) -> str | None:
    m = _FIELD_IN_MESSAGE.match(message)
    return m.group(1) if m else None


def check(
    values: dict, workspace: str | Path, *, need_data: bool = True
) -> tuple[TrainConfig | None, list[dict]]:
    """Coerce, check paths and build a ``TrainConfig``: ``(config or None, [{field, message}])``.

    Paths in ``data``/``eval_data``/``init_adapter`` become absolute paths inside the workspace;
    ``model``, ``data`` and ``eval_data`` too when they name a path (a hub id such as ``org/name``
    with no such local path is passed through: the loader resolves it from the local cache or
    says why it cannot).
    """
    if not isinstance(values, dict):
        return None, [{"field": None, "message": "config must be an object of setting: value"}]
    kinds = {
        f.name: (field_type(f.type), "None" in str(f.type)) for f in dataclasses.fields(TrainConfig)
    }
    errors: list[dict] = []
    clean: dict[str, Any] = {}
    for name, value in values.items():
        if name in UI_OWNED:
            continue
        if name not in kinds:
            errors.append({"field": name, "message": f"unknown setting {name!r}"})
            continue
        try:
            kind, nullable = kinds[name]
            clean[name] = _coerce(name, kind, value, nullable)
        except ValueError as err:
            errors.append({"field": name, "message": f"{name}={value!r}: {err}"})
    for name in PATH_FIELDS:
        _resolve_paths(clean, name, workspace, errors)
    try:
        clean["model"] = resolve_model(clean.get("model"), workspace)
    except UIError as err:
        errors.append({"field": "model", "message": str(err)})
    if need_data and not clean.get("data"):
        errors.append({"field": "data", "message": "no training data: pick at least one file"})
    if errors:
        return None, errors
    try:
        return TrainConfig.from_dict(clean, source="form"), []
    except ConfigError as err:
        return None, [{"field": _message_field(str(err)), "message": str(err)}]


def _resolve_paths(clean: dict, name: str, workspace, errors: list[dict]) -> None:
    value = clean.get(name)
    if not value:
        return
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        try:
            if name in ("data", "eval_data"):
                out.append(resolve_data(item, workspace))
            else:
                out.append(str(resolve_in(workspace, item, must_exist=True)))
        except UIError as err:
            errors.append({"field": name, "message": str(err)})
    clean[name] = out if isinstance(value, list) else (out[0] if out else None)


def resolve_data(item: str, workspace) -> str:
    """A data source named by the page: a file or dataset folder inside the workspace (made
    absolute), or a Hugging Face hub id that is no workspace path (read from the local datasets
    cache, offline). Raises ``UIError`` for paths outside or missing."""
    local = Path(workspace) / item
    if not local.exists() and not item.startswith(("/", ".", "~")) and hf_datasets.is_hub_id(item):
        return item
    return str(resolve_in(workspace, item, must_exist=True))


def read_options(values: dict) -> ReadOptions:
    """The split / subset / column mapping of a preview request, as the trainer reads them."""
    columns = values.get("data_columns") or []
    try:
        pairs = parse_columns(columns.split() if isinstance(columns, str) else columns)
    except ValueError as err:
        raise BadRequest(f"data_columns: {err}") from None
    return ReadOptions(values.get("data_split") or None, values.get("data_subset") or None, pairs)


def resolve_model(model: str | None, workspace) -> str | None:
    """A model named by the page: None (built-in default), a path inside the workspace (made
    absolute), or a hub id such as ``org/name`` that is no local path (the loader resolves it
    from the local cache or says why it cannot). Raises ``UIError`` for paths outside."""
    if not model:
        return None
    local = Path(workspace) / model
    if (
        model.startswith(("/", ".", "~"))
        or local.exists()
        or model.endswith(".gguf")
        or ".." in model
    ):
        return str(resolve_in(workspace, model, must_exist=True))
    return model


def to_cli(cfg: TrainConfig) -> str:
    """The ``lorafuse train`` command line of ``cfg``: only the fields that differ from defaults."""
    defaults, values = TrainConfig(), cfg.to_dict()
    changed = {k: v for k, v in values.items() if v != getattr(defaults, k) and v is not None}
    return shlex.join(["lorafuse", "train", *TrainConfig.to_flags(changed)])


def to_yaml(cfg: TrainConfig) -> str:
    """The YAML config file of ``cfg`` (what ``--config`` reads), all fields, in field order."""
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
