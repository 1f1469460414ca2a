"""TrainConfig: validation, file round trips, flag overrides, shipped configs."""

from __future__ import annotations

import glob
import json
import os

import pytest

from lorafuse.train.config import ConfigError, TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_validation_names_the_field():
    with pytest.raises(ConfigError, match=r"lora_r=0: must be > 0"):
        TrainConfig(lora_r=0)
    with pytest.raises(ConfigError, match=r"lr_scheduler='step'"):
        TrainConfig(lr_scheduler="step")
    with pytest.raises(ConfigError, match=r"too_long='cut'"):
        TrainConfig(too_long="cut")
    with pytest.raises(ConfigError, match=r"quantize_embeddings=True: needs load_in_4bit"):
        TrainConfig(quantize_embeddings=True)


def test_json_round_trip(tmp_path):
    cfg = TrainConfig(
        data=["a.jsonl"], lora_r=8, target_modules=["q_proj"], max_steps=3, adam_betas=[0.8, 0.9]
    )
    path = str(tmp_path / "c.json")
    cfg.save(path)
    assert TrainConfig.from_file(path) == cfg


def test_yaml_and_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: one.jsonl\nlora_r: 4\nlr: 1.0e-4\n")
    cfg = TrainConfig.from_file(str(path), {"lr": 3e-4})
    assert (cfg.data, cfg.lora_r, cfg.lr) == (["one.jsonl"], 4, 3e-4)
    path.write_text("data: one.jsonl\nlora_rank: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown setting\(s\) \['lora_rank'\]"):
        TrainConfig.from_file(str(path))


def test_flags_override_config_file(tmp_path, capsys):
    from lorafuse.commands import main

    path = tmp_path / "c.yaml"
    path.write_text("data: [a.jsonl, b.jsonl]\nlora_r: 4\npacking: true\n")
    assert (
        main(["train", "--config", str(path), "--lora-r", "32", "--no-packing", "--print-config"])
        == 0
    )
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["data"], cfg["lora_r"], cfg["packing"]) == (["a.jsonl", "b.jsonl"], 32, False)


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))), ids=os.path.basename
)
def test_shipped_configs_load(path):
    cfg = TrainConfig.from_file(path)
    assert cfg.data, f"{path} names no training data"
    for f in cfg.data + cfg.eval_data:
        assert os.path.isfile(os.path.join(REPO, f)), f"{path}: data file {f} does not exist"


def test_shipped_configs_exist():
    assert glob.glob(os.path.join(REPO, "configs", "*.yaml"))


def test_read_checkpoint_config(tmp_path):
    from lorafuse.train.checkpoint import CheckpointError, read_checkpoint_config

    TrainConfig(model="m", data=["d.jsonl"]).save(str(tmp_path / "lorafuse_config.json"))
    got = read_checkpoint_config(str(tmp_path))
    assert got["model"] == "m" and got["max_seq_length"] == 2048 and got["load_in_4bit"] is False
    with pytest.raises(CheckpointError, match="not a lorafuse checkpoint"):
        read_checkpoint_config(str(tmp_path / "nope"))
