"""Fixtures for the data tests: a tiny byte-level BPE tokenizer with a ChatML template."""

from __future__ import annotations

import json

import pytest

from lorafuse.testing import single_thread


@pytest.fixture(scope="session")
def tokenizer():
    from lorafuse.testing import chat_tokenizer

    return chat_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path):
    """write_jsonl(name, records or raw lines) -> path"""

    def write(name, records):
        path = tmp_path / name
        with open(path, "w", encoding="utf-8") as f:
            for r in records:
                f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
        return str(path)

    return write


one_thread = pytest.fixture(autouse=True)(single_thread)
