"""The trainer's own choices: checkpointing decided from the memory estimate and stored."""

from __future__ import annotations

import platform

import pytest


@pytest.mark.parametrize("available, expected", [(64 * 2**30, False), (1024, True)])
def test_unset_checkpointing_is_decided_and_stored(make_config, monkeypatch, available, expected):
    from lorafuse.models import grad_checkpointing
    from lorafuse.train import distributed as dist
    from lorafuse.train.trainer import Trainer

    monkeypatch.setattr("lorafuse.models.memory.available_bytes", lambda device: available)
    trainer = Trainer(make_config(gradient_checkpointing=None, max_steps=1), dist.setup("none"))
    trainer.setup()
    assert trainer.cfg.gradient_checkpointing is expected  # what checkpoints store
    assert bool(grad_checkpointing.mode_of(trainer.model)) is expected
    assert trainer.cfg.to_dict()["gradient_checkpointing"] is expected


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
@pytest.mark.parametrize("fused", [True, False])
def test_the_run_applies_the_heap_policy_and_reverts_it(make_config, monkeypatch, fused):
    """The run owns the process-wide heap policy: the fused run applies it in setup (the stock
    baseline leaves the process alone) and execute() reverts it when the run ends."""
    from lorafuse import heap
    from lorafuse.train import distributed as dist
    from lorafuse.train.loop import execute
    from lorafuse.train.status import RunStatus
    from lorafuse.train.trainer import Trainer

    heap.revert_training_policy()
    seen = []  # the heap threshold while the loop runs
    monkeypatch.setattr("lorafuse.train.loop.run_loop", lambda r, s: seen.append(heap.threshold()))
    trainer = Trainer(make_config(max_steps=1, fused=fused), dist.setup("none"))
    execute(trainer, RunStatus(trainer.cfg.output_dir))
    assert (seen[0] > 0) is fused and (trainer.heap_policy is not None) is fused
    assert heap.threshold() == 0  # reverted
