"""examples/grpo_date_codes.py: its reward by hand, and (slow) the whole script on a tiny model.
The real-model run takes too long for a test on a small CPU (see its docstring)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_date_codes.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_date_codes", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_date_code_reward_by_hand():
    reward = _example().date_code_reward
    answers = ["2023-07-04"] * 6
    completions = ["2023-07-04", " 2023-07-04\n", "2023-7-4 is it", "2023-04-07", "July 4, 2023",
                   [{"role": "assistant", "content": "no idea"}]]  # fmt: skip
    got = reward(prompts=[None] * 6, completions=completions, answer=answers)
    assert got == pytest.approx([1.0, 1.0, 0.6, 0.4, 0.2, 0.0])


@pytest.mark.slow
def test_the_example_runs_on_a_tiny_model(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", ["grpo_date_codes.py", "--tiny", "--steps", "2",
                                      "--eval-prompts", "4", "--prompts-per-step", "2",
                                      "--num-generations", "2", "--out", str(tmp_path)])  # fmt: skip
    _example().main()
    out = capsys.readouterr().out
    assert "held-out reward before training" in out and "after 2 GRPO steps" in out
