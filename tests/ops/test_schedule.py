"""The C++ kernels deal their parallel work from a shared counter (common.h's ``parallel_tasks`` /
``parallel_rows``) unless ``set_dynamic_schedule(False)`` asks for at::parallel_for's equal
shares. A task's result must not depend on the thread that runs it, so both schedules give the
same bits. Shapes here are large enough (at 2 threads) for every kernel to take the dealt path.
"""

from __future__ import annotations

import pytest
import torch

from lorafuse import backends
from lorafuse.ops import attention, cross_entropy, rms_norm, rope, swiglu
from lorafuse.ops.nf4 import quantize_nf4

pytestmark = pytest.mark.skipif(not backends.cpp_available(), reason="C++ extension not built")

BF16 = torch.bfloat16


@pytest.fixture
def ext():
    from lorafuse import _ext

    ext = _ext.load_cpp()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the dealt path needs 2+ threads, also on a 1-core runner
    yield ext
    ext.set_dynamic_schedule(True)
    torch.set_num_threads(threads)


def _both_schedules(ext, run):
    """``run()``'s tensors under the static, then the dynamic schedule."""
    out = {}
    for dynamic in (False, True):
        ext.set_dynamic_schedule(dynamic)
        torch.manual_seed(0)
        out[dynamic] = [t.detach().clone() for t in run()]
    return out[False], out[True]


def _assert_same_bits(static, dealt):
    assert len(static) == len(dealt)
    for a, b in zip(static, dealt):
        assert torch.equal(a, b)


def _leaf(*shape, dtype=BF16, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()


def test_attention_same_bits_under_both_schedules(ext):
    gen = torch.Generator().manual_seed(1)
    # 2 x 3 kv heads x 4 row blocks of 64: 24 forward tasks of growing cost, 6 backward tasks.
    q, k, v = (
        _leaf(2, 6, 256, 64, gen=gen),
        _leaf(2, 3, 256, 64, gen=gen),
        _leaf(2, 3, 256, 64, gen=gen),
    )

    def run():
        q.grad = k.grad = v.grad = None
        out = attention.causal_attention(q, k, v, 0.125, backend="cpp")
        out.backward(torch.ones_like(out))
        return out, q.grad, k.grad, v.grad

    _assert_same_bits(*_both_schedules(ext, run))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_row_kernels_same_bits_under_both_schedules(ext, dtype):
    gen = torch.Generator().manual_seed(2)
    # Odd widths: chunk ends inside vectors and rows. Each kernel needs >= 16 grains to be dealt:
    # RMSNorm 2048 / 102 rows, SwiGLU 2048 * 1100 / 32768, RoPE 10 * 2048 / 512.
    n, d, inter = 2048, 320, 1100
    x, w = _leaf(n, d, dtype=dtype, gen=gen), torch.randn(d, generator=gen).to(dtype)
    gate, up = _leaf(n, inter, dtype=dtype, gen=gen), _leaf(n, inter, dtype=dtype, gen=gen)
    q, k = _leaf(1, 8, n, 64, dtype=dtype, gen=gen), _leaf(1, 2, n, 64, dtype=dtype, gen=gen)
    cos, sin = torch.randn(1, n, 64, generator=gen), torch.randn(1, n, 64, generator=gen)

    def run():
        for t in (x, gate, up, q, k):
            t.grad = None
        y = rms_norm.rms_norm(x, w, 1e-6, backend="cpp")  # frozen weight: rows dealt in backward
        h = swiglu.swiglu(gate, up, backend="cpp")
        qo, ko = rope.apply_rope(q, k, cos.to(dtype), sin.to(dtype), backend="cpp")
        (y.float().sum() + h.float().sum() + qo.float().sum() + ko.float().sum()).backward()
        return y, h, qo, ko, x.grad, gate.grad, up.grad, q.grad, k.grad

    _assert_same_bits(*_both_schedules(ext, run))


def test_loss_rank_add_and_nf4_same_bits_under_both_schedules(ext):
    gen = torch.Generator().manual_seed(3)
    hidden, head = _leaf(512, 64, gen=gen), torch.randn(3000, 64, generator=gen).to(BF16)
    targets = torch.randint(0, 3000, (512,), generator=gen)
    y0 = torch.randn(2048, 576, generator=gen).to(BF16)
    xa, B = torch.randn(2048, 16, generator=gen), torch.randn(576, 16, generator=gen)
    weight = torch.randn(1536, 1024, generator=gen)
    nf4 = quantize_nf4(weight)

    def run():
        hidden.grad = None
        loss = cross_entropy.fused_linear_cross_entropy(hidden, head, targets, backend="cpp")
        loss.backward()
        y = y0.clone()
        ext.lora_rank_up_add_(y, xa, B, 0.5)
        deq = torch.empty(1536, 1024, dtype=BF16)
        ext.nf4_dequantize_forward(
            nf4["codes"], nf4["absmax_q"], nf4["absmax_scale"], nf4["absmax_offset"], deq
        )
        return loss, hidden.grad, y, deq

    _assert_same_bits(*_both_schedules(ext, run))


def test_dealt_schedule_covers_every_task_once(ext):
    """A skipped chunk would leave the fresh output uninitialised, a repeated one would add twice:
    the dealt result must equal plain torch math, not only the static kernel."""
    ext.set_dynamic_schedule(True)
    gen = torch.Generator().manual_seed(4)
    y0 = torch.randn(4096, 96, generator=gen).to(BF16)
    xa, B = torch.randn(4096, 4, generator=gen), torch.randn(96, 4, generator=gen)
    y = y0.clone()
    ext.lora_rank_up_add_(y, xa, B, 1.0)
    expected = (y0.float() + xa @ B.t()).to(BF16)
    assert (y.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()
    g, u = (
        torch.randn(3000, 700, generator=gen).to(BF16),
        torch.randn(3000, 700, generator=gen).to(BF16),
    )
    h = swiglu.swiglu(g, u, backend="cpp")
    torch.testing.assert_close(h, torch.nn.functional.silu(g.float()).mul(u.float()).to(BF16))
