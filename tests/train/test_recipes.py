"""The method registry (``lorafuse.train.recipes``): the one list of methods the config, the CLI
help and the engine read."""

from __future__ import annotations

import pytest

from lorafuse.train import recipes
from lorafuse.train.config import METHODS, ConfigError, TrainConfig
from lorafuse.train.trainer import Trainer


def test_config_reads_the_registry():
    assert METHODS == tuple(recipes.METHODS)
    with pytest.raises(ConfigError, match="method='nope': " + " [|] ".join(recipes.METHODS)):
        TrainConfig(method="nope")


@pytest.mark.parametrize("name", sorted(recipes.METHODS))
def test_every_entry_has_a_trainer(name):
    assert issubclass(recipes.METHODS[name].trainer(), Trainer)


def test_entry_check_is_the_method_config_group(monkeypatch):
    """TrainConfig runs the entry's check: a check that refuses refuses the config."""
    calls = []

    def refuse(cfg, need):
        calls.append(cfg.method)
        need(False, "beta", "refused by the entry")

    entry = recipes.METHODS["kto"]
    monkeypatch.setitem(recipes.METHODS, "kto", recipes.Method(
        entry.help, refuse, entry.rows, entry.objective, entry.trainer))  # fmt: skip
    with pytest.raises(ConfigError, match="refused by the entry"):
        TrainConfig(method="kto")
    assert calls == ["kto"]
    assert (
        TrainConfig(method="dpo").beta == 0.1
        and TrainConfig(method="grpo", reward=["exact"]).beta == 0.0
    )
