"""`lorafuse eval`: perplexity matches a direct HF computation; accuracy counts are right."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lorafuse.commands import main
from lorafuse.evaluation.metrics import encode_dataset, perplexity, task_accuracy
from lorafuse.generation import SamplingParams, encode_messages, generate_batch
from lorafuse.models.resolve import load_resolved, resolve_spec

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello world",
    "What is the capital of France? Paris.",
]


@pytest.fixture(scope="module")
def loaded(tiny_ws):
    # fp32 asked for: the perplexity checks compare at fp32 tolerances (the auto dtype is bf16
    # on a CPU with native bf16)
    model, tok, _ = load_resolved(
        resolve_spec(checkpoint=str(tiny_ws["checkpoint"])), dtype=torch.float32
    )
    return model, tok


def test_perplexity_matches_hf_loss(tiny_ws, loaded, tmp_path):
    model, tok = loaded
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    rows = encode_dataset([str(data)], tok, 256)
    got = perplexity(model, rows, batch_size=3)
    # oracle: HF's own shifted mean loss per row, weighted by its number of predicted tokens
    nll = n = 0
    with torch.no_grad():
        for ids, labels in rows:
            out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
            k = sum(1 for t in labels[1:] if t != -100)
            nll, n = nll + out.loss.item() * k, n + k
    assert got["tokens"] == n
    # fp32, padded batch vs one row at a time: summation-order differences only
    assert got["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert perplexity(model, rows, batch_size=1)["perplexity"] == pytest.approx(
        got["perplexity"], rel=1e-5
    )


def test_task_accuracy_counts(loaded):
    model, tok = loaded
    msgs = [[{"role": "user", "content": t}] for t in TEXTS]
    preds = generate_batch(
        model, tok, [encode_messages(tok, m) for m in msgs], SamplingParams(max_new_tokens=8)
    )
    assert all(p.strip() for p in preds)
    records = [
        {"messages": msgs[0], "answer": preds[0]},  # exact (and contains)
        {
            "messages": msgs[1],
            "answer": preds[1].strip()[:2],
        },  # contains only (prefix of the output)
        {"messages": msgs[2], "answer": "certainly not generated \u2603"},  # neither
    ]
    r = task_accuracy(model, tok, records, max_new_tokens=8, batch_size=2)
    assert (r.n, r.exact, r.contains) == (3, 1 + int(len(preds[1].strip()) <= 2), 2)


def test_cli_side_by_side_table_and_json(tiny_ws, tmp_path, capsys):
    task = tmp_path / "task.jsonl"
    task.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": t}], "answer": "Paris"}) + "\n"
            for t in TEXTS
        )
    )
    out = tmp_path / "r.json"
    rc = main(["eval", "--model", str(tiny_ws["base"]), "--adapter", f"a={tiny_ws['adapter_a']}",
               "--adapter", f"b={tiny_ws['adapter_b']}", "--task", str(task), "--ppl-data", str(task),
               "--max-new-tokens", "4", "--json", str(out)])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["metric", "base", "a", "b"]
    assert "perplexity" in table and "exact match (n=3)" in table
    res = json.loads(out.read_text())
    assert list(res["columns"]) == ["base", "a", "b"]
    ppl = [res["columns"][c]["perplexity"]["perplexity"] for c in ("base", "a", "b")]
    assert len(set(ppl)) == 3  # the adapters really were switched


def test_cli_errors(tiny_ws, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "x"}], "answer": "y"}\n{"messages": []}\n'
    )
    assert main(["eval", "--checkpoint", str(tiny_ws["checkpoint"]), "--task", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tiny_ws["checkpoint"])]) == 2


@pytest.mark.slow
def test_cli_lm_eval_tasks_side_by_side(tiny_ws, tmp_path, capsys, monkeypatch):
    """--lm-eval-tasks: base and adapter columns through the in-process server; the base column
    equals lm-eval's own hf backend on the same model."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from lorafuse.testing import write_lm_eval_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = write_lm_eval_tasks(tmp_path / "tasks")
    out = tmp_path / "r.json"
    rc = main(["eval", "--model", str(tiny_ws["base"]), "--adapter", f"a={tiny_ws['adapter_a']}",
               "--dtype", "fp32", "--lm-eval-tasks", str(tasks["lf_mc"]), str(tasks["lf_gen"]),
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["metric", "base", "a"]
    assert sorted(r.split()[:2] for r in table[2:]) == [["lf_gen", "exact_match"], ["lf_mc", "acc"]]
    res = json.loads(out.read_text())
    assert res["lm_eval_tasks"] == [str(tasks["lf_mc"]), str(tasks["lf_gen"])]
    want = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(tiny_ws["base"]), "dtype": "float32", "device": "cpu"},
        tasks=["lf_mc", "lf_gen"], task_manager=TaskManager(include_path=str(tmp_path / "tasks"),
                                                           include_defaults=False),
    )["results"]  # fmt: skip
    base = res["columns"]["base"]["lm_eval"]
    assert base["lf_mc"]["acc,none"] == want["lf_mc"]["acc,none"]
    assert base["lf_gen"]["exact_match,none"] == want["lf_gen"]["exact_match,none"]
    assert set(res["columns"]["a"]["lm_eval"]) == {"lf_mc", "lf_gen"}


def test_cli_lm_eval_task_needing_a_download_stops(tiny_ws, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    task = tmp_path / "remote.yaml"
    task.write_text("task: remote_qa\ndataset_path: someorg/some_dataset\noutput_type: "
                    "generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")  # fmt: skip
    args = ["eval", "--checkpoint", str(tiny_ws["checkpoint"]), "--lm-eval-tasks"]
    assert main([*args, str(task)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'remote_qa' needs a download (someorg/some_dataset)" in err and "loaded" not in err
    gone = tmp_path / "local.yaml"
    gone.write_text("task: gone\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                    f"{tmp_path / 'nope.jsonl'}\n")  # fmt: skip
    assert main([*args, str(gone)]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert main([*args, str(tmp_path / "missing.yaml")]) == 2
    assert "task file not found" in capsys.readouterr().err


def test_cli_task_and_perplexity_from_a_hugging_face_dataset(tiny_ws, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": t, "solution": "Paris"} for t in TEXTS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]),
                          "test": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "qa")  # fmt: skip
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["question"]}],
                                        "answer": r["solution"]}) + "\n" for r in rows))  # fmt: skip
    base = ["eval", "--model", str(tiny_ws["base"]), "--max-new-tokens", "4", "--json", "-"]
    assert main([*base, "--task", str(task)]) == 0
    want = json.loads(capsys.readouterr().out)["columns"]["base"]["task"]
    assert main([*base, "--task", str(tmp_path / "qa"),
                 "--data-columns", "prompt=question,answer=solution"]) == 0  # fmt: skip
    got = json.loads(capsys.readouterr().out)["columns"]["base"]["task"]
    assert got["n"] == len(TEXTS) and got == want  # the test split, read as the same records
    assert main([*base, "--ppl-data", str(tmp_path / "qa"), "--data-split", "train",
                 "--data-columns", "prompt=question", "completion=solution"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["columns"]["base"]["perplexity"]["tokens"] > 0
    assert main([*base, "--task", str(tmp_path / "qa"), "--data-columns", "answer=reply"]) == 2
    assert "qa[test]:1: no column 'reply'" in capsys.readouterr().err


def test_python_callers_compare_base_and_adapter_without_the_cli(loaded, tmp_path):
    """``lorafuse eval``'s columns come from library functions: each column is the metric with
    that variant active, and the table names every column."""
    from lorafuse.evaluation.compare import compare, format_table
    from lorafuse.models.resolve import use_adapter

    model, tok = loaded
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    rows = encode_dataset([str(data)], tok, 256)
    columns = compare(model, tok, ["adapter"], rows=rows, batch_size=3)
    assert list(columns) == ["base", "adapter"]
    for name, adapter in (("base", None), ("adapter", "adapter")):
        with use_adapter(model, adapter):
            assert columns[name]["perplexity"] == perplexity(model, rows, batch_size=3)
    assert columns["base"]["perplexity"] != columns["adapter"]["perplexity"]
    table = format_table({"columns": columns}).splitlines()
    assert table[0].split() == ["metric", "base", "adapter"] and table[2].startswith("perplexity")
