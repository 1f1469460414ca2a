"""GRPO rewards (train/rewards.py): parsing, built-ins, TRL-signature callables, clear errors."""

from __future__ import annotations

import math

import pytest

from lorafuse.train.rewards import RewardError, parse_reward, score

PROMPTS = ["what is 2+2?", "what is 3+3?"]
COLS = {"answer": ["4", "6"]}


def test_builtins_and_weights():
    rs = [parse_reward("exact=2"), parse_reward("regex:^\\d+$=0.5"), parse_reward("length:3")]
    assert [r.weight for r in rs] == [2.0, 0.5, 1.0]
    total, per = score(rs, PROMPTS, [" 4 ", "sixsix"], COLS)
    assert per == [[1.0, 0.0], [0.0, 0.0], [0.0, -1.0]]
    assert total == [2.0, -1.0]


def test_chat_completions_and_regex_with_equals():
    r = parse_reward("regex:a=b")  # '=b' is not a number: part of the pattern
    assert r.weight == 1.0
    total, _ = score([r], PROMPTS, [[{"role": "assistant", "content": "xa=b"}], "ab"], COLS)
    assert total == [1.0, 0.0]


def test_import_path_and_file(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def n_chars(prompts, completions, answer, **kw):\n"
                 "    return [len(c) if a != '6' else None for c, a in zip(completions, answer)]\n")  # fmt: skip
    r = parse_reward(f"{f}:n_chars=0.5")
    total, per = score([r, parse_reward("exact")], PROMPTS, ["abcd", "6"], COLS)
    assert total == [2.0, 1.0] and math.isnan(per[0][1])  # None: does not apply
    assert parse_reward("math:sqrt").fn is math.sqrt


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("nosuch.module:f", "cannot load nosuch.module:f"),
        ("math:nosuch", "cannot load math:nosuch"),
        ("math:pi", "not callable"),
        ("bogus", "not a built-in"),
        ("regex:(", "not a valid regular expression"),
        ("length:-3", "positive integer"),
        ("exact=inf", "finite"),
    ],
)
def test_bad_specs(spec, problem):
    with pytest.raises(RewardError, match=problem):
        parse_reward(spec)


@pytest.mark.parametrize(
    "body, problem",
    [
        (
            "raise ValueError('boom')",
            r"reward .*bad raised ValueError: boom \(prompts from 'what is 2\+2\?'\)",
        ),
        ("return [1.0]", r"returned 1 values for 2 completions"),
        (
            "return [1.0, float('nan')]",
            r"returned nan for the completion of prompt 'what is 3\+3\?'",
        ),
        ("return [1.0, 'x']", r"returned 'x' \(not a number\)"),
        ("return 3", r"returned int, not a list"),
    ],
)
def test_reward_errors_name_the_reward_and_prompt(tmp_path, body, problem):
    f = tmp_path / "bad_rewards.py"
    f.write_text(f"def bad(prompts, completions, **kw):\n    {body}\n")
    with pytest.raises(RewardError, match=problem):
        score([parse_reward(f"{f}:bad")], PROMPTS, ["a", "b"], COLS)


def test_exact_needs_the_column():
    with pytest.raises(RewardError, match="no column 'label'"):
        score([parse_reward("exact:label")], PROMPTS, ["a", "b"], COLS)
