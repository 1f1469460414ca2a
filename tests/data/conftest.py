"""Fixtures for the data tests: a tiny byte-level BPE tokenizer with a ChatML template."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="session")
def tokenizer():
    from lorafuse.serve.tiny import build_tokenizer

    return build_tokenizer()


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


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core CI box OpenMP barriers
    under oversubscription made each tiny op ~60x slower (measured: 21 s vs 0.35 s)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
