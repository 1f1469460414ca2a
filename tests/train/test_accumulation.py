"""Loss normalisation: k accumulated micro-batches give the gradient of one big batch.

Rows have different numbers of target tokens, so averaging per-micro-batch means (the classic
mistake) would give a different gradient; normalising by the target tokens of the whole step gives
the same one. fp32, tiny model: differences are summation-order rounding only.
"""

from __future__ import annotations

import pytest
import torch

from lorafuse.train import distributed as dist
from lorafuse.train.engine import Trainer

# the tests replace optimizer.step to capture gradients; torch warns about that, harmlessly
pytestmark = pytest.mark.filterwarnings(
    "ignore:Seems like `optimizer.step\\(\\)` has been overridden"
)


def _first_step_grads(cfg):
    trainer = Trainer(cfg, dist.setup("none"))
    trainer.setup()
    captured = {}

    def capture():
        captured.update(
            {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        )

    trainer.optimizer.step = capture
    fig = trainer.train_step()
    return fig, captured


@pytest.mark.parametrize("packing", [False, True])
def test_accumulated_equals_big_batch(make_config, packing, close):
    big_fig, big = _first_step_grads(
        make_config(batch_size=4, grad_accum=1, packing=packing, max_seq_length=64)
    )
    acc_fig, acc = _first_step_grads(
        make_config(batch_size=1, grad_accum=4, packing=packing, max_seq_length=64)
    )
    assert big_fig["tokens"] == acc_fig["tokens"] and big_fig["examples"] == acc_fig["examples"]
    # loss: the same mean over the same target tokens (fp32 sums in another order: ~1e-7 relative)
    assert abs(big_fig["loss"] - acc_fig["loss"]) <= 1e-5 * abs(big_fig["loss"])
    assert big.keys() == acc.keys() and big
    for name in big:
        # fp32; gradients of order 1e-2..1: 1e-6 absolute + 1e-4 relative covers reordered sums
        close(acc[name], big[name], atol=1e-6, rtol=1e-4, name=name)


def test_grad_scale_matters(make_config):
    """Guard that the comparison above can fail: halving the normaliser changes the gradient."""
    _, g1 = _first_step_grads(make_config(batch_size=2, max_seq_length=64, packing=False))
    cfg = make_config(batch_size=2, max_seq_length=64, packing=False)
    trainer = Trainer(cfg, dist.setup("none"))
    trainer.setup()
    original = trainer.objective.loss
    trainer.objective.loss = lambda model, rows, n: original(model, rows, n / 2)
    grads = {}
    trainer.optimizer.step = lambda: grads.update(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    )
    trainer.train_step()
    name = next(iter(g1))
    assert torch.allclose(grads[name], 2 * g1[name], rtol=1e-4, atol=1e-7)
