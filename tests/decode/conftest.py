"""Fixtures of the decode engine's tests: every test here runs the C++ step."""

import pytest

from lorafuse import backends
from lorafuse.testing import save_tiny_model


@pytest.fixture(autouse=True)
def _needs_cpp():
    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny model's tokenizer (SmolLM2's vocabulary)."""
    return save_tiny_model(tmp_path_factory.mktemp("tok"))[1]
