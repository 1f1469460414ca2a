"""Triton gated delta rule (forward and decoding step; no backward) against the torch backend
(ops/gated_delta_chunks.py)."""

from __future__ import annotations

import pytest
import torch
from tritonlib import DEVICE, interpret_on_cpu  # noqa: F401  (fixture)

from lorafuse.ops import gated_delta_chunks as ref
from lorafuse.testing import rms_error
from lorafuse.triton import gated_delta as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]


def _inputs(b, t, hk, hv, dk, dv, n, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen)
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(n, hv, dk, dv, generator=gen)
    low = [x.to(dtype) for x in (q, k, v)]
    return [x.to(DEVICE) for x in (*low, g, beta.to(dtype), state)]


# (B, T, Hk, Hv, Dk, Dv, cu_seqlens), chunks of 16 (the interpreter's cost; the GPU runs 64): a
# ragged chunk, grouped heads, packed examples across chunk boundaries, one token a row (the
# decoding kernel), Dk not a power of two.
CASES = [
    (2, 21, 1, 2, 16, 16, None),
    (1, 40, 1, 1, 16, 32, (0, 5, 40)),
    (3, 1, 1, 2, 16, 16, None),
    (1, 20, 2, 2, 24, 16, None),
]


@pytest.mark.parametrize("b, t, hk, hv, dk, dv, cu", CASES)
def test_fp32_matches_torch_backend(close, b, t, hk, hv, dk, dv, cu):
    n = b if cu is None else len(cu) - 1
    q, k, v, g, beta, state = _inputs(b, t, hk, hv, dk, dv, n)
    cu = None if cu is None else torch.tensor(cu, device=DEVICE)
    o, final, _ = tri.forward(q, k, v, g, beta, state, cu, True, False, chunk=16)
    o_ref, final_ref, _ = ref.forward(q, k, v, g, beta, state, cu, True, False)
    close(o, o_ref, atol=1e-5, rtol=1e-5, name="o")
    close(final, final_ref, atol=1e-5, rtol=1e-5, name="final")


def test_bf16_against_fp32_oracle():
    # bf16 q, k, v, beta: the kernel's fp32 math and one rounding of o, against the torch backend on
    # the same rounded values (which rounds o once too): as close as that rounding allows.
    q, k, v, g, beta, state = _inputs(1, 20, 1, 2, 16, 16, 1, torch.bfloat16)
    o, final, _ = tri.forward(q, k, v, g, beta, state, None, True, False, chunk=16)
    o_ref, final_ref, _ = ref.forward(q, k, v, g, beta, state, None, True, False)
    oracle, _, _ = ref.forward(*(x.float() for x in (q, k, v, g, beta)), state, None, True, False)
    assert o.dtype == torch.bfloat16
    assert rms_error(o, oracle) <= 1.5 * rms_error(o_ref, oracle)
    torch.testing.assert_close(final, final_ref, atol=1e-4, rtol=1e-4)


def test_refuses_to_save_states():
    q, k, v, g, beta, state = _inputs(1, 4, 1, 1, 16, 16, 1)
    with pytest.raises(ValueError, match="forward only"):
        tri.forward(q, k, v, g, beta, state, None, True, True)
