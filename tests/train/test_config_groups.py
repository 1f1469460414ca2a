"""TrainConfig's groups: the grouped YAML form equals the flat one, flat keys and flags keep
working, every shipped config loads, and ``--help`` lists the fields by group."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lorafuse.train.config import ConfigError, TrainConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))

GROUPED = """
model: {model: org/tiny, dtype: float32}
lora: {r: 4, lora_alpha: 8, use_dora: true}
data: {data: train.jsonl, packing: false}
optim: {lr: 0.001, batch_size: 2}
run: {output_dir: out, save_steps: 5}
method: {method: grpo}
grpo: {reward: [exact], num_generations: 4}
"""
FLAT = """
model: org/tiny
dtype: float32
lora_r: 4
lora_alpha: 8
use_dora: true
data: train.jsonl
packing: false
lr: 0.001
batch_size: 2
output_dir: out
save_steps: 5
method: grpo
reward: [exact]
num_generations: 4
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_grouped_yaml_equals_flat(tmp_path):
    grouped = TrainConfig.from_file(_write(tmp_path, "g.yaml", GROUPED))
    flat = TrainConfig.from_file(_write(tmp_path, "f.yaml", FLAT))
    assert grouped == flat
    assert grouped.lora_r == 4 and grouped.data == ["train.jsonl"] and grouped.method == "grpo"
    # flags override a grouped file's setting
    assert TrainConfig.from_file(_write(tmp_path, "g2.yaml", GROUPED), {"lora_r": 8}).lora_r == 8


@pytest.mark.parametrize(
    "text, match",
    [
        ("lora: {r: 4}\nlora_r: 8\n", "lora_r is given twice"),
        ("lora: {lr: 0.1}\n", r"lora\.lr is not a setting of group lora"),
        ("optim: {lora_r: 4}\n", r"optim\.lora_r is not a setting of group optim"),
    ],
)
def test_grouped_yaml_errors_name_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_file(_write(tmp_path, "bad.yaml", text))


def test_every_field_has_one_group():
    groups = TrainConfig.groups()
    names = [n for g in groups.values() for n in g]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(TrainConfig))
    assert len(names) == len(set(names))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    assert CONFIGS, "configs/ holds no YAML"
    cfg = TrainConfig.from_file(str(path))
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # the stored (flat) form loads back


def test_help_lists_fields_by_group(capsys):
    from lorafuse.commands import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for group in TrainConfig.groups():
        assert f"{group} settings:" in out
    assert out.index("lora settings:") < out.index("\n  --lora-r ") < out.index("vision settings:")
