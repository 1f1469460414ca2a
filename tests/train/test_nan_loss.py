"""A non-finite loss stops training with a clear message and keeps the last good checkpoint."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

from lorafuse.train import distributed as dist
from lorafuse.train.engine import Trainer, TrainingError


def test_nan_loss_stops_and_keeps_checkpoint(make_config):
    cfg = make_config(batch_size=2, max_steps=5, save_steps=1, save_total_limit=0)
    trainer = Trainer(cfg, dist.setup("none"))
    trainer.setup()
    original = trainer.objective.loss

    def poisoned(model, rows, n_items):  # the loss of step 3 becomes NaN
        loss, sums = original(model, rows, n_items)
        return (loss * float("nan") if trainer.step == 2 else loss), sums

    trainer.objective.loss = poisoned
    before = None
    with pytest.raises(
        TrainingError,
        match=r"non-finite loss \(nan\) at step 3.*Last good checkpoint: .*checkpoint-2",
    ):
        trainer.run()
    out = cfg.output_dir
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    assert not os.path.exists(os.path.join(out, "final"))
    saved = load_file(os.path.join(out, "checkpoint-2", "adapter_model.safetensors"))
    # the NaN step applied nothing: the live weights still equal checkpoint-2's
    live = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    for key, value in saved.items():
        match = [
            n
            for n in live
            if n.replace(".default", "").endswith(key.removeprefix("base_model.model."))
        ]
        assert len(match) == 1, key
        before = live[match[0]].detach()
        assert before.isfinite().all() and (before == value).all(), key
