"""The trainer's own choices: checkpointing decided from the memory estimate and stored."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("available, expected", [(64 * 2**30, False), (1024, True)])
def test_unset_checkpointing_is_decided_and_stored(make_config, monkeypatch, available, expected):
    from lorafuse.train import distributed as dist
    from lorafuse.train.trainer import Trainer

    monkeypatch.setattr("lorafuse.models.memory.available_bytes", lambda device: available)
    trainer = Trainer(make_config(gradient_checkpointing=None, max_steps=1), dist.setup("none"))
    trainer.setup()
    assert trainer.cfg.gradient_checkpointing is expected  # what checkpoints store
    assert bool(trainer.model.lorafuse_gradient_checkpointing) is expected
    assert trainer.cfg.to_dict()["gradient_checkpointing"] is expected
