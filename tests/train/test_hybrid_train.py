"""`lorafuse train` end to end on every hybrid family (tiny model dirs, packing on, a few steps):
the rows are packed, the report names the mixers that got example boundaries, the loss is finite
and the adapter is saved. A hybrid whose mixer lorafuse cannot run with boundaries trains unpacked
and the log says why."""

from __future__ import annotations

import json

import pytest

from lorafuse.testing.llm import chat_tokenizer
from lorafuse.testing.new_families import FAMILY_CASES, save_family_model

HYBRIDS = {
    "Qwen3_5ForCausalLM": "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeGatedDeltaNet",
    "Qwen3NextForCausalLM": "Qwen3NextGatedDeltaNet",
    "Lfm2ForCausalLM": "Lfm2ShortConv",
    "Lfm2MoeForCausalLM": "Lfm2MoeShortConv",
    "GraniteMoeHybridForCausalLM": "GraniteMoeHybridMambaLayer",
}


def _train(model_dir, data, out, capsys):
    from lorafuse.commands import main

    code = main(["train", "--model", str(model_dir), "--data", data, "--output-dir", str(out),
                 "--max-seq-length", "64", "--batch-size", "2", "--max-steps", "2",
                 "--save-steps", "0", "--lr", "1e-3", "--dtype", "float32",
                 "--target-modules", *FAMILY_CASES[model_dir.name][3],
                 "--no-gradient-checkpointing", "--no-progress"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


@pytest.mark.parametrize("arch", sorted(HYBRIDS))
def test_train_packs_a_hybrid(arch, chat_file, tmp_path, capsys):
    model_dir = tmp_path / arch
    save_family_model(arch, model_dir, chat_tokenizer())
    summary, err = _train(model_dir, chat_file, tmp_path / "out", capsys)
    assert "rows (packed)" in err and "packing off" not in err, err[-3000:]
    assert f"{HYBRIDS[arch]}[boundaries:" in err
    assert summary["steps"] == 2 and summary["train_loss"] == summary["train_loss"]  # finite
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


def test_train_turns_packing_off_where_a_mixer_cannot_isolate(chat_file, tmp_path, capsys):
    arch = "Qwen3_5ForCausalLM"
    model_dir = tmp_path / arch
    # A GELU conv activation: lorafuse's conv op applies none or SiLU, so the mixer stays stock.
    save_family_model(arch, model_dir, chat_tokenizer(), hidden_act="gelu")
    _, err = _train(model_dir, chat_file, tmp_path / "out", capsys)
    assert "packing off: Qwen3_5GatedDeltaNet (3 module(s)" in err, err[-3000:]
    assert "conv activation 'gelu'" in err and "rows (unpacked)" in err
