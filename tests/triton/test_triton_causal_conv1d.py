"""Triton causal depthwise conv1d against the torch backend (ops/causal_conv1d.py)."""

from __future__ import annotations

import pytest
import torch
from tritonlib import DEVICE, interpret_on_cpu, reference  # noqa: F401  (fixture)

from lorafuse.triton import causal_conv1d as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]

# (B, D, T, K, cu_seqlens, activation): two channel blocks, one ragged; examples shorter than the
# kernel; K = 3 without activation.
CASES = [
    (2, 70, 21, 4, None, "silu"),
    (1, 20, 41, 4, (0, 10, 12, 13, 41), "silu"),
    (1, 17, 9, 3, (0, 4, 9), None),
]


@pytest.mark.parametrize("b, d, t, k, cu, activation", CASES)
def test_fp32_matches_torch_backend(close, b, d, t, k, cu, activation):
    fwd, bwd = reference("causal_conv1d")
    gen = torch.Generator().manual_seed(t)
    n = b if cu is None else len(cu) - 1
    x = torch.randn(b, t, d, generator=gen).transpose(1, 2).to(DEVICE)  # channels adjacent
    w, bias = torch.randn(d, k, generator=gen).to(DEVICE), torch.randn(d, generator=gen).to(DEVICE)
    state = torch.randn(n, d, k - 1, generator=gen).to(DEVICE)
    dy, dfinal = torch.randn(b, d, t, generator=gen).to(DEVICE), torch.randn(n, d, k - 1).to(DEVICE)
    cu = None if cu is None else torch.tensor(cu, device=DEVICE)
    y, final = tri.forward(x, w, bias, activation, state, cu, n)
    y_ref, final_ref = fwd(x, w, bias, activation, state, cu, n)
    close(y, y_ref, atol=1e-5, rtol=1e-5, name="y")
    close(final, final_ref, atol=0, rtol=0, name="final")
    needs = (True, True, True, True)
    grads = tri.backward(dy, dfinal, x, w, bias, activation, state, cu, n, needs)
    grads_ref = bwd(dy, dfinal, x, w, bias, activation, state, cu, n, needs)
    for name, a, e in zip(("dx", "dweight", "dbias", "dstate"), grads, grads_ref):
        close(a, e, atol=1e-5, rtol=1e-5, name=name)


def test_bf16_rounds_once(close):
    fwd, _ = reference("causal_conv1d")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 30, 19, generator=gen).bfloat16().to(DEVICE)
    w, bias = (
        torch.randn(30, 4, generator=gen).to(DEVICE),
        torch.randn(30, generator=gen).to(DEVICE),
    )
    y, _ = tri.forward(x, w, bias, "silu", None, None, 2)
    y32, _ = fwd(x.float(), w, bias, "silu", None, None, 2)  # fp32 oracle on the same values
    assert y.dtype == torch.bfloat16
    close(y.float(), y32, atol=1e-6, rtol=2**-8, name="y")  # one rounding: half a bf16 ulp
