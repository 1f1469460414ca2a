"""Fixtures for the training tests: tiny random Llama dirs, small chat and preference datasets."""

from __future__ import annotations

import json
import random

import pytest

from lorafuse.testing import single_thread
from lorafuse.testing.preference import pair_records


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from lorafuse.testing import save_tiny_model

    path = tmp_path_factory.mktemp("tiny_model")
    save_tiny_model(path)
    return str(path)


def chat_records(n: int, seed: int = 0) -> list[dict]:
    """Mixed-length chats (so micro-batches hold different numbers of target tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        question = "what is " + " and ".join(
            str(rng.randint(0, 99)) for _ in range(rng.randint(1, 6))
        )
        answer = "the answer is " + " ".join(str(a + b) for _ in range(rng.randint(1, 8)))
        out.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return out


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    with open(path, "w") as f:
        for r in chat_records(48):
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture
def make_config(tiny_model_dir, chat_file, tmp_path):
    """make_config(**overrides) -> a TrainConfig for the tiny model (fast: no bar, no checkpointing)."""
    from lorafuse.train.config import TrainConfig

    def make(**kw):
        base = dict(model=tiny_model_dir, data=[chat_file], output_dir=str(tmp_path / "out"),
                    max_seq_length=128, gradient_checkpointing=False, progress=False,
                    save_steps=0, lr=1e-3, dtype="float32", device="cpu")  # fmt: skip
        base.update(kw)
        return TrainConfig(**base)

    return make


@pytest.fixture(scope="session")
def pair_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pair_records(24)))
    return str(path)


@pytest.fixture(scope="session")
def plain_model_dir(tmp_path_factory):
    from lorafuse.testing import save_tiny_model

    path = tmp_path_factory.mktemp("tiny_plain")
    save_tiny_model(path, scale=1.0)
    return str(path)


@pytest.fixture
def pref_config(tiny_model_dir, pair_file, tmp_path):
    def make(**kw):
        base = dict(model=tiny_model_dir, data=[pair_file], output_dir=str(tmp_path / "out"),
                    max_seq_length=64, gradient_checkpointing=False, progress=False, save_steps=0,
                    lr=1e-3, dtype="float32", device="cpu", method="dpo", beta=0.5,
                    lr_scheduler="constant", num_threads=1)  # fmt: skip
        base.update(kw)
        from lorafuse.train.config import TrainConfig

        return TrainConfig(**base)

    return make


one_thread = pytest.fixture(autouse=True)(single_thread)
