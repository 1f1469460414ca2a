"""Preference records (data/preference.py; named _pairs because tests/train/test_preference.py
takes the basename): formats, masking of the response only, file:line errors, counts."""

from __future__ import annotations

import pytest

from lorafuse.data.dataset import DataSpec
from lorafuse.data.formats import DataError
from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.data.preference import build_pairs, read_pairs

TEXT = {"prompt": "what is the sky?", "chosen": " blue", "rejected": " red"}
CHAT = {
    "prompt": [{"role": "user", "content": "what is the sky?"}],
    "chosen": [{"role": "assistant", "content": "blue"}],
    "rejected": [{"role": "assistant", "content": "the sky is red"}],
}


def _targets(enc, tok) -> str:
    return tok.decode([t for t in enc.labels if t != IGNORE_INDEX])


def _spec(path, **kw):
    return DataSpec(train_files=[path], max_seq_length=kw.pop("max_seq_length", 128), **kw)


def test_text_pairs_target_the_response_and_eos(write_jsonl, tokenizer):
    data = build_pairs(_spec(write_jsonl("p.jsonl", [TEXT])), tokenizer)
    (pair,) = data.train
    assert _targets(pair.chosen, tokenizer) == " blue" + tokenizer.eos_token
    assert _targets(pair.rejected, tokenizer) == " red" + tokenizer.eos_token
    prompt_ids = tokenizer(TEXT["prompt"])["input_ids"]
    assert pair.chosen.input_ids[: len(prompt_ids)] == prompt_ids
    assert pair.chosen.labels[0] == IGNORE_INDEX


@pytest.mark.parametrize("implicit", [False, True])
def test_chat_pairs_use_the_template(write_jsonl, tokenizer, implicit):
    rec = CHAT
    if implicit:  # TRL's implicit prompt: two full conversations sharing all turns but the last
        rec = {"chosen": CHAT["prompt"] + CHAT["chosen"],
               "rejected": CHAT["prompt"] + CHAT["rejected"]}  # fmt: skip
    (pair,) = build_pairs(_spec(write_jsonl("c.jsonl", [rec])), tokenizer).train
    assert _targets(pair.chosen, tokenizer).startswith("blue")
    assert _targets(pair.rejected, tokenizer).startswith("the sky is red")
    assert "what is the sky" not in _targets(pair.chosen, tokenizer)
    text = tokenizer.decode(pair.chosen.input_ids)
    assert "<|im_start|>user" in text and "<|im_start|>assistant" in text


def test_assistant_turns_inside_the_prompt_are_not_targets(write_jsonl, tokenizer):
    rec = dict(CHAT, prompt=[{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello there"},
                             {"role": "user", "content": "what is the sky?"}])  # fmt: skip
    (pair,) = build_pairs(_spec(write_jsonl("m.jsonl", [rec])), tokenizer).train
    assert "hello there" not in _targets(pair.chosen, tokenizer)
    assert _targets(pair.chosen, tokenizer).startswith("blue")


@pytest.mark.parametrize(
    "bad, problem",
    [
        ({"prompt": "p", "chosen": "c"}, "missing field 'rejected'"),
        ({"prompt": "p", "chosen": "  ", "rejected": "r"}, "empty response in 'chosen'"),
        ({"chosen": "c", "rejected": "r"}, "missing field 'prompt'"),
        ({"prompt": "p", "chosen": 3, "rejected": "r"}, "field 'chosen' must be a string"),
        (
            dict(CHAT, rejected=[{"role": "assistant", "content": ""}]),
            "empty response in 'rejected'",
        ),
        (dict(CHAT, chosen=[{"role": "user", "content": "x"}]), "chosen has no assistant turn"),
        ({"chosen": CHAT["chosen"], "rejected": CHAT["rejected"]}, "do not share all turns"),
        ('{"prompt": ', "invalid JSON"),
    ],
)
def test_errors_name_file_and_line(write_jsonl, bad, problem):
    path = write_jsonl("bad.jsonl", [TEXT, bad])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{problem}"):
        read_pairs([path])


def test_skip_bad_and_identical_pairs_are_counted(write_jsonl, tokenizer):
    same = dict(TEXT, rejected=TEXT["chosen"])
    path = write_jsonl("s.jsonl", [TEXT, {"prompt": "p"}, same, same])
    data = build_pairs(_spec(path, skip_bad_records=True), tokenizer)
    assert len(data.train) == 3
    assert data.stats["bad_records_skipped"] == 1 and data.stats["identical_pairs"] == 2
    assert data.stats["bad_record_examples"][0].startswith(f"{path}:2:")


def test_too_long_truncates_drops_or_errors(write_jsonl, tokenizer):
    long = dict(TEXT, chosen="blue " * 40)
    path = write_jsonl("l.jsonl", [TEXT, long])
    cut = build_pairs(_spec(path, max_seq_length=16), tokenizer)
    assert cut.stats["truncated"] == 1 and len(cut.train) == 2
    assert max(len(p.chosen.input_ids) for p in cut.train) == 16
    dropped = build_pairs(_spec(path, max_seq_length=16, too_long="drop"), tokenizer)
    assert dropped.stats["dropped_too_long"] == 1 and len(dropped.train) == 1
    with pytest.raises(DataError, match=r"l.jsonl:2: sequence is \d+ tokens"):
        build_pairs(_spec(path, max_seq_length=16, too_long="error"), tokenizer)


def test_csv_with_messages_cells(tmp_path, tokenizer):
    import json

    pd = pytest.importorskip("pandas")
    path = tmp_path / "p.csv"
    pd.DataFrame([{k: json.dumps(v) for k, v in CHAT.items()}]).to_csv(path, index=False)
    (pair,) = build_pairs(_spec(str(path)), tokenizer).train
    assert _targets(pair.chosen, tokenizer).startswith("blue")
    with open(path, "a") as f:
        f.write('"[{""role"": ""user"", ""content"": ""q""}]","[]","[]"\n')
    with pytest.raises(DataError, match=r"p.csv:3: .*non-empty list"):
        read_pairs([str(path)])


def test_padding_pair_has_no_targets(write_jsonl, tokenizer):
    (pair,) = build_pairs(_spec(write_jsonl("z.jsonl", [TEXT])), tokenizer).train
    pad = pair.zeroed()
    assert pad.n_examples == 0 and pad.n_targets == 0 and pad.n_tokens == pair.n_tokens
