"""ImageTrainConfig: flags, YAML and checkpoint config give the same fields; bad values name the
field; text-encoder caching refuses captions that change."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lorafuse.commands import main
from lorafuse.image.config import ImageTrainConfig
from lorafuse.train.config import ConfigError


def test_flags_and_yaml_resolve_to_the_same_config(tmp_path, capsys):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("network_dim: 16\nshuffle_caption: true\nadam_betas: [0.9, 0.99]\n")
    assert main(["train-image", "--config", str(cfg_file), "--keep-tokens", "2",
                 "--print-config"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert (out["network_dim"], out["shuffle_caption"], out["keep_tokens"]) == (16, True, 2)
    assert out["adam_betas"] == [0.9, 0.99] and out["lr_scheduler"] == "constant"
    assert out == ImageTrainConfig(**{**out}).to_dict()


def test_help_shows_every_field_doc(capsys):
    with pytest.raises(SystemExit):
        main(["train-image", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(ImageTrainConfig):
        assert " ".join(f.metadata["help"].split()) in text, f.name


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
        ({"resolution": 500}, "resolution=500: must be a positive multiple of 8"),
        ({"caption_dropout_rate": 1.0}, "caption_dropout_rate"),
        ({"max_bucket_reso": 128, "min_bucket_reso": 256}, "max_bucket_reso=128"),
        ({"sample_every_n_steps": 5}, "needs --sample-prompts"),
        ({"cache_text_encoder_outputs": True, "shuffle_caption": True},
         "cache_text_encoder_outputs=True: .*shuffle_caption is on"),
        ({"cache_text_encoder_outputs": True, "train_text_encoder": True,
          "caption_dropout_rate": 0.1}, "train_text_encoder, caption_dropout_rate"),
    ],
)  # fmt: skip
def test_bad_values_name_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        ImageTrainConfig(**kw)


def test_unknown_setting_in_a_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"network_rank": 8}))
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['network_rank'\]"):
        ImageTrainConfig.from_file(str(f))
    assert ImageTrainConfig(caption_extension="txt").caption_extension == ".txt"
