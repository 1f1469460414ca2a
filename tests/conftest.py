"""Shared test fixtures. The helpers themselves live in :mod:`lorafuse.testing`, a real module,
so that test folders with their own conftest.py can never shadow them."""

from __future__ import annotations

import os

import pytest
import torch

from lorafuse.testing import assert_close, available_backends, tiny_llama_config  # noqa: F401

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def close():
    return assert_close
