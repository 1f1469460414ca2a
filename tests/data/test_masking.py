"""Chat template rendering, loss masks (-100 outside assistant turns), truncation."""

from __future__ import annotations

import pytest

from lorafuse.data.formats import DataError, Example
from lorafuse.data.masking import IGNORE_INDEX, encode

MSGS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is the capital of France?"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "and 2+2?"},
    {"role": "assistant", "content": "4"},
]


def _targets(tokenizer, enc):
    return tokenizer.decode([t for t in enc.labels if t != IGNORE_INDEX])


def test_only_assistant_tokens_are_targets(tokenizer):
    enc = encode(Example("f:1", messages=MSGS), tokenizer, 512)
    full = tokenizer.apply_chat_template(MSGS, tokenize=False)
    assert tokenizer.decode(enc.input_ids) == full  # one tokenization of the rendered chat
    # both assistant turns and their end-of-turn token, nothing else
    assert _targets(tokenizer, enc) == "Paris<|im_end|>\n4<|im_end|>\n"
    for ids_label, tok in zip(enc.labels, enc.input_ids):
        assert ids_label in (IGNORE_INDEX, tok)


def test_train_on_inputs(tokenizer):
    enc = encode(Example("f:1", messages=MSGS), tokenizer, 512, train_on_inputs=True)
    assert enc.labels[0] == IGNORE_INDEX  # the first token is never predicted
    assert enc.labels[1:] == enc.input_ids[1:]


def test_prompt_completion_and_text(tokenizer):
    enc = encode(Example("f:1", prompt="Q: hello ", completion="world"), tokenizer, 512)
    # completion + EOS; " w" straddles the border and holds a target character, so it is a target
    assert _targets(tokenizer, enc) == " world<|im_end|>"
    enc = encode(Example("f:1", completion="the quick brown fox"), tokenizer, 512)
    assert enc.labels[0] == IGNORE_INDEX
    assert tokenizer.decode([t for t in enc.labels if t != IGNORE_INDEX]) == tokenizer.decode(
        enc.input_ids[1:]
    )


def test_too_long(tokenizer):
    ex = Example("data.jsonl:7", messages=MSGS)
    full = encode(ex, tokenizer, 512)
    short = encode(ex, tokenizer, 20)
    assert short.truncated and short.input_ids == full.input_ids[:20]
    assert encode(ex, tokenizer, 20, too_long="drop") is None
    with pytest.raises(
        DataError, match=r"data.jsonl:7: record is \d+ tokens, longer than max_seq_length=20"
    ):
        encode(ex, tokenizer, 20, too_long="error")


def test_missing_chat_template_uses_chatml_with_warning():
    from lorafuse.data.masking import ensure_chat_template
    from lorafuse.testing import chat_tokenizer

    tok = chat_tokenizer()
    tok.chat_template = None
    with pytest.warns(UserWarning, match="no chat template"):
        ensure_chat_template(tok)
    assert "<|im_start|>" in tok.apply_chat_template(MSGS, tokenize=False)
