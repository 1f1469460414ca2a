"""Fixtures of the UI tests: a workspace holding a tiny model and a chat file."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A tiny Llama (+ chat tokenizer) and a 16-record chat file, copied into each workspace."""
    from lorafuse.testing import save_tiny_model

    root = tmp_path_factory.mktemp("ui_template")
    save_tiny_model(root / "model")
    (root / "data").mkdir()
    with open(root / "data" / "chat.jsonl", "w") as f:
        for i in range(16):
            msgs = [{"role": "user", "content": f"what is {i} plus one"},
                    {"role": "assistant", "content": f"the answer is {i + 1}"}]  # fmt: skip
            f.write(json.dumps({"messages": msgs}) + "\n")
    return root


@pytest.fixture
def ws(template, tmp_path):
    root = tmp_path / "ws"
    shutil.copytree(template, root)
    return root
