from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_ws(tmp_path_factory):
    """Tiny random Llama + tokenizer + two adapters + a checkpoint dir (lorafuse.testing)."""
    from lorafuse.testing import make_tiny_workspace

    return make_tiny_workspace(tmp_path_factory.mktemp("tiny_ws"))
