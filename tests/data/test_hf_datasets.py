"""Hugging Face datasets as data: a save_to_disk folder, .arrow files, a hub id from the local
cache (offline), with split / subset choice and column mapping for every record format."""

from __future__ import annotations

import glob

import pytest

datasets = pytest.importorskip("datasets")

from lorafuse.data import hf_datasets  # noqa: E402
from lorafuse.data.formats import DataError, read_examples  # noqa: E402
from lorafuse.data.grpo import read_prompts  # noqa: E402
from lorafuse.data.kto import read_kto  # noqa: E402
from lorafuse.data.preference import read_pairs  # noqa: E402
from lorafuse.data.read_options import ReadOptions, parse_columns  # noqa: E402
from lorafuse.testing.hf_cache import cache_hub_dataset  # noqa: E402

QA = [{"question": f"what is {i}+{i}?", "answer": str(2 * i)} for i in range(5)]
CHAT = [
    {"dialog": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
    for r in QA
]  # fmt: skip


@pytest.fixture
def saved_dict(tmp_path):
    """A save_to_disk DatasetDict: train (QA[:4]) and test (QA[4:])."""
    path = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(QA[:4]),
                          "test": datasets.Dataset.from_list(QA[4:])}).save_to_disk(path)  # fmt: skip
    return str(path)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """HF_HOME at a temp dir whose datasets cache holds org/qa (subsets main, extra)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    cache = tmp_path / "hf" / "datasets"
    cache_hub_dataset(cache, "org/qa", {"train": QA[:3], "test": QA[3:]}, subset="main")
    cache_hub_dataset(cache, "org/qa", {"train": QA[:1]}, subset="extra")
    return cache


def opts(columns="", **kw) -> ReadOptions:
    return ReadOptions(columns=parse_columns([columns] if columns else []), **kw)


def qa_examples(source, **kw):
    return read_examples([source], options=opts("prompt=question,completion=answer", **kw))


def test_save_to_disk_folder_splits_and_columns(saved_dict):
    got = qa_examples(saved_dict)  # default: the train split
    assert [(e.prompt, e.completion) for e in got] == [(r["question"], r["answer"]) for r in QA[:4]]
    assert got[0].source == f"{saved_dict}[train]:1"
    assert [e.completion for e in qa_examples(saved_dict, split="test")] == ["8"]
    assert [e.completion for e in qa_examples(saved_dict, role="eval")] == ["8"]  # eval: test
    with pytest.raises(DataError, match=r"saved: no split 'dev'; it has train, test"):
        qa_examples(saved_dict, split="dev")


def test_single_dataset_folder_and_arrow_files(tmp_path):
    datasets.Dataset.from_list(QA).save_to_disk(tmp_path / "one")
    assert len(qa_examples(str(tmp_path / "one"))) == 5
    arrow = glob.glob(str(tmp_path / "one" / "*.arrow"))
    assert len(arrow) == 1
    assert [e.prompt for e in qa_examples(arrow[0])] == [r["question"] for r in QA]
    with pytest.raises(DataError, match="one table with no splits"):
        qa_examples(arrow[0], split="test")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one written by save_to_disk"):
        qa_examples(str(tmp_path / "plain"))


def test_hub_id_from_the_local_cache_offline(hub_cache):
    offline_before = datasets.config.HF_HUB_OFFLINE
    got = qa_examples("org/qa", subset="main")
    assert [e.completion for e in got] == [r["answer"] for r in QA[:3]]
    assert got[0].source == "org/qa[train]:1"
    assert [e.completion for e in qa_examples("org/qa", subset="main", split="test")] == ["6", "8"]
    assert len(qa_examples("org/qa", subset="extra")) == 1
    assert datasets.config.HF_HUB_OFFLINE == offline_before  # offline only for the call
    with pytest.raises(DataError, match="multiple 'org/qa' configurations.*--data-subset"):
        qa_examples("org/qa")
    with pytest.raises(DataError) as err:
        qa_examples("org/missing")
    message = str(err.value)
    assert "\n" not in message and str(hub_cache) in message, message
    assert message.startswith("org/missing: no such file, and no dataset 'org/missing'")


def test_eval_role_never_picks_a_lone_train_split(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(QA)}).save_to_disk(tmp_path / "d")
    with pytest.raises(DataError, match="only a train split.*--eval-data-split train"):
        qa_examples(str(tmp_path / "d"), role="eval")
    assert len(qa_examples(str(tmp_path / "d"), role="eval", split="train")) == 5


# every record format, read from a dataset whose columns carry other names
FORMAT_CASES = {
    "messages": (CHAT, "messages=dialog", lambda e: e.messages[-1]["content"]),
    "sharegpt": ([{"turns": [{"from": "human", "value": r["question"]},
                             {"from": "gpt", "value": r["answer"]}]} for r in QA],
                 "conversations=turns", lambda e: e.messages[-1]["content"]),
    "alpaca": (QA, "instruction=question,output=answer", lambda e: e.messages[-1]["content"]),
    "prompt_completion": (QA, "prompt=question,completion=answer", lambda e: e.completion),
    "text": ([{"body": r["answer"]} for r in QA], "text=body", lambda e: e.completion),
}  # fmt: skip


@pytest.mark.parametrize("fmt", list(FORMAT_CASES))
def test_column_mapping_for_each_sft_format(tmp_path, fmt):
    records, columns, answer = FORMAT_CASES[fmt]
    datasets.Dataset.from_list(records).save_to_disk(tmp_path / fmt)
    got = read_examples([str(tmp_path / fmt)], options=opts(columns))
    assert [answer(e) for e in got] == [r["answer"] for r in QA]
    with pytest.raises(DataError, match="unknown record format"):  # unmapped: not readable
        read_examples([str(tmp_path / fmt)])


def test_column_mapping_for_preference_kto_and_grpo(tmp_path):
    pref = [{"q": r["question"], "good": r["answer"], "bad": "no"} for r in QA]
    datasets.Dataset.from_list(pref).save_to_disk(tmp_path / "pref")
    pairs = read_pairs([str(tmp_path / "pref")], options=opts("prompt=q,chosen=good,rejected=bad"))
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs][0] == (QA[0]["question"], "0", "no")
    kto = [{"q": r["question"], "a": r["answer"], "ok": i % 2 == 0} for i, r in enumerate(QA)]
    datasets.Dataset.from_list(kto).save_to_disk(tmp_path / "kto")
    rows = read_kto([str(tmp_path / "kto")], options=opts("prompt=q,completion=a,label=ok"))
    assert [r.label for r in rows] == [True, False, True, False, True]
    datasets.Dataset.from_list(QA).save_to_disk(tmp_path / "grpo")
    prompts = read_prompts([str(tmp_path / "grpo")], options=opts("prompt=question"))
    assert prompts[1].prompt == QA[1]["question"] and prompts[1].columns == {"answer": "2"}


def test_column_mapping_on_files_and_its_errors(write_jsonl):
    path = write_jsonl("qa.jsonl", QA)
    assert [e.completion for e in qa_examples(path)] == [r["answer"] for r in QA]
    with pytest.raises(DataError, match=r"qa.jsonl:1: no column 'reply' \(--data-columns\)"):
        read_examples([path], options=opts("prompt=question,completion=reply"))
    for bad in ("prompt", "prompt=", "=question", "prompt=a,prompt=b"):
        with pytest.raises(ValueError):
            parse_columns([bad])
    assert parse_columns({"prompt": "q"}) == (("prompt", "q"),)


def test_sources_are_told_apart(tmp_path):
    assert hf_datasets.is_hub_id("org/name") and hf_datasets.is_hub_id("squad")
    assert not hf_datasets.is_hub_id("missing.jsonl") and not hf_datasets.is_hub_id("a/b/c")
    with pytest.raises(DataError, match="missing.jsonl: no such file"):
        read_examples([str(tmp_path / "missing.jsonl")])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        read_examples([str(tmp_path / "notes.txt")])
