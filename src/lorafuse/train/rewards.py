"""GRPO rewards: TRL's reward-function signature, named on the command line, checked on every call.

A reward is any callable ``f(prompts, completions, **columns) -> list[float | None]`` (TRL's
signature: one value per completion; ``None`` = "does not apply", it adds nothing, as TRL's
``nansum``). ``--reward`` names it:

* ``mypkg.rewards:func`` (an import path; a ``.py`` file path before the colon works too);
* a built-in: ``exact[:column]`` (1 if the completion, stripped, equals the row's ``column``,
  default ``answer``), ``regex:<pattern>`` (1 if the pattern matches anywhere, ``re.search``
  with DOTALL), ``length[:max_chars]`` (``-max(0, len - max_chars) / max_chars``, default 200);
* followed by ``=<weight>`` (default 1), e.g. ``exact=1 regex:^<answer>=0.5``.

Completions are strings, or (chat) lists of messages as TRL passes them; built-ins read the text.
A reward that raises, returns the wrong number of values, a non-number or NaN stops the run with
:class:`RewardError` naming the reward and the prompt concerned.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from lorafuse.errors import LorafuseError


class RewardError(LorafuseError, RuntimeError):
    """A reward cannot be loaded or returned something unusable (the message says which)."""


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion if m.get("role") == "assistant")


# ---- built-ins (TRL's signature) --------------------------------------------------------------
def exact_match(column: str = "answer") -> Callable:
    def exact(prompts, completions, **columns):
        if column not in columns:
            raise KeyError(f"the data has no column {column!r} (columns: {sorted(columns)})")
        return [
            float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, columns[column])
        ]

    return exact


def regex_match(pattern: str) -> Callable:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise RewardError(
            f"reward regex:{pattern}: not a valid regular expression ({err})"
        ) from None

    def regex(prompts, completions, **columns):
        return [float(compiled.search(_text(c)) is not None) for c in completions]

    return regex


def length_penalty(max_chars: int = 200) -> Callable:
    def length(prompts, completions, **columns):
        return [-max(0, len(_text(c)) - max_chars) / max_chars for c in completions]

    return length


# ---- parsing -----------------------------------------------------------------------------------
@dataclass
class Reward:
    name: str  # as given, without the weight: what logs and errors call it
    fn: Callable
    weight: float = 1.0


def _split_weight(spec: str) -> tuple[str, float]:
    head, sep, tail = spec.rpartition("=")
    if sep:
        try:
            return head, float(tail)
        except ValueError:
            pass  # '=' inside a regex, not a weight
    return spec, 1.0


def _import(target: str, spec: str) -> Callable:
    mod_name, _, attr = target.rpartition(":")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            loader = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(mod_name))[0], mod_name
            )
            if loader is None or not os.path.isfile(mod_name):
                raise FileNotFoundError(f"no such file {mod_name}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
        fn = getattr(module, attr)
    except Exception as err:  # ImportError, AttributeError, errors inside the module
        raise RewardError(
            f"reward {spec}: cannot load {target} ({type(err).__name__}: {err})"
        ) from None
    if not callable(fn):
        raise RewardError(f"reward {spec}: {target} is not callable")
    return fn


def parse_reward(spec: str) -> Reward:
    """``--reward`` value -> :class:`Reward` (see the module docstring for the forms)."""
    name, weight = _split_weight(spec.strip())
    if not math.isfinite(weight):
        raise RewardError(f"reward {spec}: the weight must be a finite number")
    kind, _, arg = name.partition(":")
    if kind == "exact":
        return Reward(name, exact_match(arg or "answer"), weight)
    if kind == "regex":
        if not arg:
            raise RewardError(f"reward {spec}: regex needs a pattern (regex:<pattern>)")
        return Reward(name, regex_match(arg), weight)
    if kind == "length":
        try:
            limit = int(arg) if arg else 200
        except ValueError:
            limit = 0
        if limit <= 0:
            raise RewardError(f"reward {spec}: length:<max_chars> needs a positive integer")
        return Reward(name, length_penalty(limit), weight)
    if ":" not in name:
        raise RewardError(
            f"reward {spec}: not a built-in (exact, regex, length) nor module:function"
        )
    return Reward(name, _import(name, spec), weight)


# ---- scoring -----------------------------------------------------------------------------------
def _short(prompt) -> str:
    text = (
        _text(prompt)
        if not isinstance(prompt, list)
        else " | ".join(str(m.get("content", "")) for m in prompt)
    )
    return repr(text if len(text) <= 80 else text[:77] + "...")


def score(rewards: list[Reward], prompts: list, completions: list, columns: dict[str, list]):
    """``(total, per_reward)``: the weighted sum per completion and each reward's raw values
    (``None`` kept as NaN, so per-reward means can skip it as TRL's ``nanmean``)."""
    n = len(completions)
    per = []
    for r in rewards:
        try:
            values = r.fn(prompts=prompts, completions=completions, **columns)
        except Exception as err:
            raise RewardError(
                f"reward {r.name} raised {type(err).__name__}: {err} (prompts from {_short(prompts[0])})"
            ) from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"reward {r.name} returned {type(values).__name__}, not a list"
            ) from None
        if len(values) != n:
            raise RewardError(
                f"reward {r.name} returned {len(values)} values for {n} completions "
                f"(prompts from {_short(prompts[0])})"
            )
        row = []
        for i, v in enumerate(values):
            if v is None:
                row.append(math.nan)
                continue
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise RewardError(
                    f"reward {r.name} returned {v!r} (not a number) for the completion of prompt "
                    f"{_short(prompts[i])}"
                ) from None
            if not math.isfinite(v):
                raise RewardError(
                    f"reward {r.name} returned {v} for the completion of prompt {_short(prompts[i])}"
                )
            row.append(v)
        per.append(row)
    total = [sum(r.weight * row[i] for r, row in zip(rewards, per) if not math.isnan(row[i]))
             for i in range(n)]  # fmt: skip
    return total, per


def combine(rewards: list[Reward], per: list[list[float]]):
    """The weighted total per completion as TRL sums it (fp32 ``nansum``), NaN where no reward
    applies (all ``None``): such completions are left out of the group statistics."""
    import torch

    values = torch.tensor(per, dtype=torch.float32).T  # (N, rewards)
    weights = torch.tensor([r.weight for r in rewards], dtype=torch.float32)
    total = (values * weights).nansum(dim=1)  # (N,)
    total[torch.isnan(values).all(dim=1)] = float("nan")
    return total
