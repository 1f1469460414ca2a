"""Every command's ``--help`` renders: exit 0, its own usage line, and every flag's help text as
written (argparse %-formats help strings, so a stray ``%`` once printed a dict of its internals)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lorafuse.commands import COMMANDS, main


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_renders(capsys, command):
    out = _help(capsys, command)
    assert out.startswith(f"usage: lorafuse {command}")
    assert "'option_strings'" not in out and "'dest'" not in out  # argparse's own dict leaked


def test_top_level_help_lists_every_command(capsys):
    out = _help(capsys)
    for command in COMMANDS:
        assert command in out


def test_train_help_shows_each_field_doc_verbatim(capsys):
    from lorafuse.train.config import TrainConfig

    text = " ".join(_help(capsys, "train").split())
    for f in dataclasses.fields(TrainConfig):
        doc = " ".join(f.metadata["help"].split())
        assert doc in text, f"--{f.name.replace('_', '-')}: help text mangled"
    # the default after the field's own text (gradient checkpointing: None, decided by the
    # memory estimate, which the text explains)
    assert re.search(r"\(vision-language models: on\) \(default: None\)", text)


@pytest.mark.parametrize("command", ["chat", "infer", "eval", "serve"])
def test_generation_commands_take_a_compute_dtype(capsys, command):
    out = _help(capsys, command)
    assert "--dtype {auto,fp32,bf16,fp16}" in out
