"""`lorafuse train` end to end on a tiny model: outputs, logs, errors."""

from __future__ import annotations

import json
import os

import pytest


@pytest.mark.slow
def test_train_cli_end_to_end(tiny_model_dir, chat_file, tmp_path, capsys):
    from lorafuse.commands import main

    out = tmp_path / "out"
    code = main(["train", "--model", tiny_model_dir, "--data", chat_file, "--output-dir", str(out),
                 "--max-seq-length", "96", "--batch-size", "2", "--max-steps", "4", "--save-steps", "2",
                 "--eval-split", "0.1", "--lr", "1e-3", "--no-gradient-checkpointing", "--no-progress",
                 "--save-total-limit", "1"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert (
        summary["steps"] == 4 and summary["eval_loss"] is not None and summary["tokens_per_s"] > 0
    )
    assert "training summary" in captured.err
    # the run applied the CPU heap policy and, owning it, reverted it when it ended
    from lorafuse import heap

    assert "glibc keeps freed buffers" in captured.err
    assert heap.threshold() == 0 and heap.large_buffers_from() == 0
    # keep the last K=1 checkpoint (the final step's) + final/
    assert sorted(os.listdir(out)) == ["checkpoint-4", "final", "logging.jsonl", "status.json"]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == status["total_steps"] == 4
    assert status["adapter"] == str(out / "final") and status["summary"]["steps"] == 4
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "lorafuse_config.json",
        "tokenizer.json",
    ):
        assert (out / "final" / name).is_file(), name
    for name in ("trainer_state.safetensors", "trainer_state.json", "lorafuse_manifest.json"):
        assert (out / "checkpoint-4" / name).is_file(), name
    assert not (out / "final" / "trainer_state.safetensors").exists()
    assert (out / "final" / "lorafuse_manifest.json").is_file()
    assert not (out / "run.lock").exists()  # released at the end
    stored = json.loads((out / "final" / "lorafuse_config.json").read_text())
    assert (
        stored["model"] == tiny_model_dir
        and stored["max_seq_length"] == 96
        and stored["dtype"] is None
    )
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    steps = [r for r in logs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "samples_per_s",
        "peak_mem_mb",
        "elapsed_s",
    ):
        assert key in steps[0], key
    assert any("eval_loss" in r for r in logs)

    # the adapter is a stock PEFT adapter dir
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    PeftModel.from_pretrained(base, str(out / "final"))


def test_train_cli_bad_record_error(tiny_model_dir, tmp_path, capsys):
    from lorafuse.commands import main

    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"text": 5}\n')
    code = main(["train", "--model", tiny_model_dir, "--data", str(data), "--output-dir", str(tmp_path / "o"),
                 "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert f"{data}:2: field 'text' must be a string, got int" in err


def test_train_cli_needs_data(capsys):
    from lorafuse.commands import main

    assert main(["train"]) == 2
    assert "no training data" in capsys.readouterr().err


def test_train_on_a_cached_hub_dataset_with_column_mapping(tiny_model_dir, tmp_path, monkeypatch,
                                                           capsys):  # fmt: skip
    pytest.importorskip("datasets")
    from lorafuse.commands import main
    from lorafuse.testing.hf_cache import cache_hub_dataset

    qa = [{"question": f"what is {i} plus {i}", "answer": f"it is {2 * i}"} for i in range(12)]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    cache_hub_dataset(tmp_path / "hf" / "datasets", "org/qa", {"train": qa[:9], "test": qa[9:]},
                      subset="main")  # fmt: skip
    out = tmp_path / "out"
    code = main(["train", "--model", tiny_model_dir, "--data", "org/qa", "--eval-data", "org/qa",
                 "--data-subset", "main", "--data-columns", "prompt=question,completion=answer",
                 "--output-dir", str(out), "--max-seq-length", "48", "--max-steps", "2",
                 "--save-steps", "0", "--no-gradient-checkpointing", "--no-progress",
                 "--dtype", "float32", "--device", "cpu"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "9 train / 3 eval examples" in captured.err  # train split, test split for eval
    assert json.loads(captured.out.strip().splitlines()[-1])["eval_loss"] is not None
    stored = json.loads((out / "final" / "lorafuse_config.json").read_text())
    assert stored["data_columns"] == ["prompt=question,completion=answer"]
    assert stored["data"] == ["org/qa"] and stored["data_subset"] == "main"
