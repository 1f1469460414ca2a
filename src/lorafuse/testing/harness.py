"""A small lm-evaluation-harness task pair with local data, for tests that run ``lm_eval``
offline: ``lf_mc`` (multiple choice: loglikelihood requests) and ``lf_gen`` (generate_until).

The questions use the tiny chat tokenizer's corpus words so prompts stay short; ``lf_gen`` stops
on four ``until`` strings, so lm-eval's API models send five stop sequences (the EOS text is
added), more than OpenAI's limit of four.
"""

from __future__ import annotations

import json
from pathlib import Path

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Rome"], 0),
    ("The quick brown fox jumps over the", ["lazy dog", "cat", "moon", "hello"], 0),
    ("LoRA adapters are merged into the", ["base weights", "GGUF files", "world", "answer"], 0),
    ("hello", ["world", "fox", "dog", "question"], 0),
    ("0123", ["456789", "abc", "fox", "system"], 0),
    ("user assistant", ["system", "hello", "world", "answer"], 0),
    ("GGUF files load in", ["llama.cpp", "Paris", "the dog", "base"], 0),
    ("The capital of France is", ["Paris", "quick", "LoRA", "0123"], 0),
]

_MC = """task: lf_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

_GEN = """task: lf_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", ".", "?", "Q:"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_lm_eval_tasks(root) -> dict[str, Path]:
    """Write both tasks (data JSONL + task YAML) under ``root``; returns task name -> YAML path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n"
                          for q, c, y in QUESTIONS))  # fmt: skip
    gen.write_text("".join(json.dumps({"question": q, "answer": c[y]}) + "\n"
                           for q, c, y in QUESTIONS))  # fmt: skip
    paths = {"lf_mc": root / "lf_mc.yaml", "lf_gen": root / "lf_gen.yaml"}
    paths["lf_mc"].write_text(_MC.format(data=json.dumps(str(mc))))
    paths["lf_gen"].write_text(_GEN.format(data=json.dumps(str(gen))))
    return paths
