"""KTO records (data/kto.py): the three forms, the completion-only targets, prompt/completion split
(the KL pairs need it), labels, file:line errors."""

from __future__ import annotations

import pytest

from lorafuse.data.dataset import DataSpec
from lorafuse.data.formats import DataError
from lorafuse.data.kto import build_kto, read_kto
from lorafuse.data.masking import IGNORE_INDEX

TEXT = {"prompt": "what is the sky?", "completion": " blue", "label": True}
CHAT = {
    "prompt": [{"role": "user", "content": "what is the sky?"}],
    "completion": [{"role": "assistant", "content": "red"}],
    "label": False,
}
MESSAGES = {"messages": CHAT["prompt"] + CHAT["completion"], "label": False}


def _spec(path, **kw):
    return DataSpec(train_files=[path], max_seq_length=kw.pop("max_seq_length", 128), **kw)


def _targets(enc, tok) -> str:
    return tok.decode([t for t in enc.labels if t != IGNORE_INDEX])


def test_text_record_targets_the_completion_and_eos(write_jsonl, tokenizer):
    (row,) = build_kto(_spec(write_jsonl("k.jsonl", [TEXT])), tokenizer).train
    assert row.label is True
    assert _targets(row.enc, tokenizer) == " blue" + tokenizer.eos_token
    prompt_ids = tokenizer(TEXT["prompt"])["input_ids"]
    assert row.enc.input_ids[: row.prompt_len] == prompt_ids
    assert all(t == IGNORE_INDEX for t in row.enc.labels[: row.prompt_len])


def test_chat_and_messages_forms_agree(write_jsonl, tokenizer):
    data = build_kto(_spec(write_jsonl("c.jsonl", [CHAT, MESSAGES])), tokenizer)
    a, b = data.train
    assert (a.enc.input_ids, a.enc.labels, a.prompt_len) == (
        b.enc.input_ids,
        b.enc.labels,
        b.prompt_len,
    )
    assert _targets(a.enc, tokenizer).startswith("red") and a.label is False
    assert data.stats["desirable"] == 0 and data.stats["undesirable"] == 2


@pytest.mark.parametrize(
    "bad, problem",
    [
        ({"prompt": "p", "completion": "c"}, "missing field 'label'"),
        (dict(TEXT, label=1), "field 'label' must be a boolean"),
        (dict(TEXT, label="yes"), "field 'label' must be a boolean"),
        ({"prompt": "p", "label": True}, "missing field 'completion'"),
        (dict(TEXT, completion="  "), "empty completion"),
        (dict(TEXT, prompt=3), "field 'prompt' must be a string"),
        (
            {"messages": CHAT["prompt"], "label": True},
            "last turn of 'messages' must be the assistant",
        ),
        (dict(CHAT, completion=[{"role": "user", "content": "x"}]), "no assistant turn"),
        ('{"prompt": ', "invalid JSON"),
    ],
)
def test_errors_name_file_and_line(write_jsonl, bad, problem):
    path = write_jsonl("bad.jsonl", [TEXT, bad])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{problem}"):
        read_kto([path])


def test_csv_labels_and_skip_bad(tmp_path, tokenizer):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "k.csv"
    pd.DataFrame(
        [dict(TEXT, label="true"), dict(TEXT, label="False"), dict(TEXT, label="x")]
    ).to_csv(path, index=False)
    data = build_kto(_spec(str(path), skip_bad_records=True), tokenizer)
    assert sorted(r.label for r in data.train) == [False, True]
    assert data.stats["bad_records_skipped"] == 1


def test_padding_row_has_no_targets(write_jsonl, tokenizer):
    (row,) = build_kto(_spec(write_jsonl("z.jsonl", [TEXT])), tokenizer).train
    pad = row.zeroed()
    assert pad.n_examples == 0 and pad.n_targets == 0 and pad.enc.input_ids == row.enc.input_ids
