"""Triton cross-entropy chunk kernel against the torch reference (loss + in-place gradient)."""

from __future__ import annotations

import pytest
import torch
from tritonlib import (
    DEVICE,
    ce_chunk_ref,
    interpret_on_cpu,  # noqa: F401  (fixture)
)

from lorafuse.ops import cross_entropy_chunks as ops_ce
from lorafuse.triton import cross_entropy as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]

IGNORE = -100


def _inputs(n, V, seed=0, ignored=()):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, V, generator=gen) * 4).to(DEVICE)
    targets = torch.randint(0, V, (n,), generator=gen)
    for i in ignored:
        targets[i] = IGNORE
    return logits, targets.to(DEVICE)


@pytest.mark.parametrize("n,V", [(5, 37), (3, 2500), (1, 129)])  # 2500: three 1024-wide blocks
@pytest.mark.parametrize("grad_scale", [1.0, 0.25])
def test_loss_and_inplace_grad(close, n, V, grad_scale):
    logits, targets = _inputs(n, V, ignored=(0,) if n > 1 else ())
    loss0, grad0 = ce_chunk_ref(logits, targets, IGNORE, grad_scale)
    buf = logits.clone()
    loss = tri.chunk_forward_backward(buf, targets, IGNORE, grad_scale)
    assert loss.dtype == torch.float32 and loss.shape == (n,)
    # fp32 online logsumexp vs torch's two-pass one: differences of a few ulps of lse (~10)
    close(loss, loss0, atol=1e-5, rtol=1e-5, name="loss")
    close(buf, grad0, atol=1e-6, rtol=1e-5, name="grad (in place)")
    if n > 1:
        assert float(loss[0]) == 0.0 and bool((buf[0] == 0).all()), "ignored row must be zero"
    buf0 = logits.clone()  # the op's torch chunk kernel, the other implementations' reference
    torch_loss = ops_ce.torch_chunk_forward_backward(buf0, targets, IGNORE, grad_scale)
    close(loss, torch_loss, atol=1e-5, rtol=1e-5, name="loss")
    close(buf, buf0, atol=1e-6, rtol=1e-5, name="grad vs torch chunk kernel")


def test_all_rows_ignored():
    logits, targets = _inputs(3, 50, ignored=(0, 1, 2))
    loss = tri.chunk_forward_backward(logits, targets, IGNORE, 1.0)
    assert bool((loss == 0).all()) and bool((logits == 0).all())


@pytest.mark.parametrize("bad", [37, -1])
def test_out_of_range_target_raises(bad):
    logits, targets = _inputs(4, 37)
    targets[2] = bad
    with pytest.raises(ValueError, match=str(bad)):
        tri.chunk_forward_backward(logits, targets, IGNORE, 1.0)


def test_rejects_non_fp32_logits():
    logits, targets = _inputs(2, 16)
    with pytest.raises(ValueError, match="fp32"):
        tri.chunk_forward_backward(logits.bfloat16(), targets, IGNORE, 1.0)
