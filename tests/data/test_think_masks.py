"""Reasoning-aware loss masks on the real Qwen3 chat template (``think_tokens``)."""

from __future__ import annotations

import pytest

from lorafuse.data.formats import DataError, Example, read_examples
from lorafuse.data.masking import IGNORE_INDEX, encode
from lorafuse.data.preference import PreferenceExample, encode_response

Q1 = {"role": "user", "content": "What is 2+2?"}
Q2 = {"role": "user", "content": "And 3+3?"}
EMPTY_BLOCK = "<think>\n\n</think>\n\n"  # what Qwen3's template writes into a final turn


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from lorafuse.testing.chat_families import save_family_tokenizer

    return save_family_tokenizer("qwen3", tmp_path_factory.mktemp("qwen3"))


def target_runs(tok, enc) -> list[str]:
    """The target tokens, decoded run by run (one run per contiguous stretch of targets)."""
    runs, cur = [], []
    for t, label in zip(enc.input_ids, enc.labels):
        if label != IGNORE_INDEX:
            cur.append(t)
        elif cur:
            runs, cur = [*runs, tok.decode(cur)], []
    return runs + ([tok.decode(cur)] if cur else [])


def run(tok, messages, mode=None):
    kw = {} if mode is None else {"think_tokens": mode}
    enc = encode(Example("t:1", messages=messages), tok, 1024, **kw)
    return tok.decode(enc.input_ids), target_runs(tok, enc)


def test_injected_empty_block_is_not_trained_by_default(qwen3):
    text, default = run(qwen3, [Q1, {"role": "assistant", "content": "4"}])
    assert EMPTY_BLOCK + "4<|im_end|>" in text  # the template injects it into the final turn
    assert default == ["4<|im_end|>\n"]
    assert run(qwen3, [Q1, {"role": "assistant", "content": "4"}], "train")[1] == [
        EMPTY_BLOCK + "4<|im_end|>\n"
    ]


@pytest.mark.parametrize("where", ["field", "content"])
def test_reasoning_is_rendered_and_masked_as_chosen(qwen3, where):
    turn = (
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"}
        if where == "field"
        else {"role": "assistant", "content": "<think>\ntwo and two\n</think>\n\n4"}
    )
    full = "<think>\ntwo and two\n</think>\n\n4<|im_end|>\n"
    text, default = run(qwen3, [Q1, turn])
    assert text.endswith("<|im_start|>assistant\n" + full)
    assert default == [full]
    assert run(qwen3, [Q1, turn], "train")[1] == [full]
    assert run(qwen3, [Q1, turn], "mask-all")[1] == ["4<|im_end|>\n"]


def test_multi_turn_history_drops_its_reasoning(qwen3):
    msgs = [Q1, {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
            Q2, {"role": "assistant", "content": "6", "reasoning_content": "three and three"}]  # fmt: skip
    text, default = run(qwen3, msgs)
    assert "two and two" not in text  # Qwen3 keeps reasoning only after the last user turn
    assert "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user" in text
    last = "<think>\nthree and three\n</think>\n\n6<|im_end|>\n"
    # the first answer without its reasoning would teach answering without thinking: no target
    assert default == [last]
    assert run(qwen3, msgs, "mask-all")[1] == ["4<|im_end|>\n", "6<|im_end|>\n"]
    assert run(qwen3, msgs, "train")[1] == ["4<|im_end|>\n", last]


def test_multi_turn_without_reasoning_trains_every_turn_and_its_end(qwen3):
    msgs = [Q1, {"role": "assistant", "content": "4"}, Q2, {"role": "assistant", "content": "6"}]
    text, default = run(qwen3, msgs)
    assert text.count("<think>") == 1  # only the final turn gets the injected block
    # the history turn is re-rendered without the block; its end-of-turn token is a target too
    assert default == ["4<|im_end|>\n", "6<|im_end|>\n"]


def test_template_without_reasoning_support_gets_a_think_block(tokenizer):
    # the ChatML fixture template never reads reasoning_content: it goes into the content
    msgs = [Q1, {"role": "assistant", "content": "4", "reasoning_content": "two and two"}]
    text, default = run(tokenizer, msgs)
    assert "<|im_start|>assistant\n<think>\ntwo and two\n</think>\n\n4<|im_end|>" in text
    assert default == ["<think>\ntwo and two\n</think>\n\n4<|im_end|>\n"]
    assert run(tokenizer, msgs, "mask-all")[1] == ["4<|im_end|>\n"]


def test_preference_responses_skip_the_injected_block(qwen3):
    ex = PreferenceExample("p:1", [Q1], [{"role": "assistant", "content": "4"}],
                           [{"role": "assistant", "content": "5"}])  # fmt: skip
    enc = encode_response(ex, ex.chosen, qwen3, 1024, "truncate")
    assert target_runs(qwen3, enc) == ["4<|im_end|>\n"]
    enc = encode_response(ex, ex.chosen, qwen3, 1024, "truncate", "train")
    assert target_runs(qwen3, enc) == [EMPTY_BLOCK + "4<|im_end|>\n"]


def test_records_carry_reasoning(write_jsonl):
    ok = [{"messages": [Q1, {"role": "assistant", "content": "4", "reasoning_content": "r1"}]},
          {"messages": [Q1, {"role": "assistant", "content": "4", "reasoning": "r2"}]}]  # fmt: skip
    got = read_examples([write_jsonl("r.jsonl", ok)])
    assert [ex.messages[-1]["reasoning_content"] for ex in got] == ["r1", "r2"]
    bad = [{"messages": [Q1, {"role": "assistant", "content": "4", "reasoning_content": 3}]}]
    with pytest.raises(DataError, match=r"bad.jsonl:1: messages\[1\].reasoning_content must be"):
        read_examples([write_jsonl("bad.jsonl", bad)])
    with pytest.raises(DataError, match="think_tokens='skip'"):
        encode(Example("t:1", messages=ok[0]["messages"]), None, 64, think_tokens="skip")
