"""The form's schema and coercion agree with TrainConfig (the single source of truth)."""

from __future__ import annotations

import dataclasses

import pytest

from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.ui import form


def test_schema_covers_every_field_with_its_default():
    fields = {f["name"]: f for f in form.schema()["fields"]}
    expected = {f.name for f in dataclasses.fields(TrainConfig)} - set(form.UI_OWNED)
    assert set(fields) == expected
    defaults = TrainConfig()
    declared = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for name, f in fields.items():
        # a None default stays None (beta, loss_type: resolved per method by TrainConfig)
        want = None if declared[name] is None else getattr(defaults, name)
        assert f["default"] == want, name
        assert f["type"] in ("int", "float", "str", "bool", "list[str]", "list[float]"), f
        assert f["group"] in ("model", "lora", "data", "optimisation", "run"), f
        assert f["help"]


@pytest.mark.parametrize(
    "name", sorted(set(form.CHOICES) & {f.name for f in dataclasses.fields(TrainConfig)})
)
def test_choices_are_exactly_what_trainconfig_accepts(name):
    for value in form.CHOICES[name]:
        TrainConfig(**{name: value, **form.CHOICE_CONTEXT.get((name, value), {})})  # valid
    with pytest.raises(ConfigError, match=name):
        TrainConfig(**{name: "not-a-choice"})


def test_coercion_of_form_values(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    cfg, errors = form.check(
        {"data": "d.jsonl", "lora_r": "8", "lr": "1e-4", "packing": "false", "max_steps": "",
         "adam_betas": "0.8 0.9", "dtype": ""},
        tmp_path,
    )  # fmt: skip
    assert errors == [] and cfg.lora_r == 8 and cfg.lr == 1e-4 and cfg.packing is False
    assert cfg.max_steps is None and cfg.adam_betas == [0.8, 0.9] and cfg.dtype is None
    assert cfg.data == [str((tmp_path / "d.jsonl").resolve())]
    _, errors = form.check({"data": ["d.jsonl"], "lora_r": 2.5, "fused": "maybe"}, tmp_path)
    assert {e["field"] for e in errors} == {"lora_r", "fused"}
    cli = form.to_cli(TrainConfig(data=["a b.jsonl"], lora_r=8, packing=False))
    assert cli == "lorafuse train --lora-r 8 --data 'a b.jsonl' --no-packing"


def test_the_ui_command_line_and_the_workers_flags_parse_back_to_the_config():
    """The UI's command line (to_cli) and each torchrun worker's flags (commands.train.to_argv)
    are one TrainConfig.to_flags: both parse back through ``lorafuse train``'s parser to the
    config they came from."""
    import shlex

    from lorafuse.commands import build_parser
    from lorafuse.commands.train import resolve_config, to_argv

    cfg = TrainConfig(data=["a b.jsonl", "c.jsonl"], lora_r=8, packing=False, max_steps=7,
                      adam_betas=[0.8, 0.95], lr=3e-4, method="dpo")  # fmt: skip
    argv = shlex.split(form.to_cli(cfg))[1:]  # without the program name
    args = build_parser(argv).parse_args(argv)
    assert resolve_config(args) == cfg
    assert to_argv(args) == argv[1:]


def test_the_export_form_offers_only_outtypes_the_exporter_takes():
    from pathlib import Path

    from lorafuse.export.gguf_export import OUTTYPES, QUANTIZED
    from lorafuse.ui import jobs

    assert set(jobs.GGUF_OUTTYPES) <= set(OUTTYPES) | set(QUANTIZED)
    page = (Path(jobs.__file__).parent / "static" / "index.html").read_text()
    for outtype in jobs.GGUF_OUTTYPES:
        assert f"<option>{outtype}</option>" in page


def test_lora_variant_fields_are_on_the_form(tmp_path):
    """PEFT's LoRA variants (issue 39) reach the form from TrainConfig, init as a choice."""
    fields = {f["name"]: f for f in form.schema()["fields"]}
    for name in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "init_lora_weights",
                 "lora_bias", "loraplus_lr_ratio"):  # fmt: skip
        assert fields[name]["group"] == "lora", name
    assert fields["use_dora"]["type"] == "bool" and "DoRA" in fields["use_dora"]["help"]
    assert fields["init_lora_weights"]["choices"] == [
        "default",
        "gaussian",
        "pissa",
        "olora",
        "eva",
    ]
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    cfg, errors = form.check({"data": "d.jsonl", "use_dora": "true", "init_lora_weights": "gaussian",
                              "rank_pattern": "q_proj=4 v_proj=8"}, tmp_path)  # fmt: skip
    assert errors == [] and cfg.use_dora and cfg.rank_pattern == ["q_proj=4", "v_proj=8"]
