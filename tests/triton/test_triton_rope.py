"""Triton RoPE (q and k in one launch) against the torch reference, forward and backward."""

from __future__ import annotations

import pytest
import torch
from tritonlib import (
    DEVICE,
    assert_lowp_close,
    interpret_on_cpu,  # noqa: F401  (fixture)
    rope_forward_ref,
)

from lorafuse.triton import rope as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]


def _tables(B, T, D, dtype, gen):
    pos = torch.arange(T, dtype=torch.float32)[None, :, None] + torch.randint(
        0, 50, (B, 1, 1), generator=gen
    )
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.cat((pos * inv, pos * inv), dim=-1)  # (B, T, D), HF layout
    return ang.cos().to(dtype).to(DEVICE), ang.sin().to(dtype).to(DEVICE)


def _inputs(B, Hq, Hk, T, D, dtype, table_dtype, strided=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # HF layout: (B, T, H, D) projected, then transposed to (B, H, T, D)
        q = torch.randn(B, T, Hq, D, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
        k = torch.randn(B, T, Hk, D, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, T, D, generator=gen).to(dtype).to(DEVICE)
        k = torch.randn(B, Hk, T, D, generator=gen).to(dtype).to(DEVICE)
    cos, sin = _tables(B, T, D, table_dtype, gen)
    return q, k, cos, sin


CASES = [(2, 4, 2, 5, 16, False), (1, 3, 1, 7, 6, True), (2, 2, 2, 3, 64, True)]  # D=6: half=3


@pytest.mark.parametrize("B,Hq,Hk,T,D,strided", CASES)
def test_fp32_forward_and_backward(close, B, Hq, Hk, T, D, strided):
    q, k, cos, sin = _inputs(B, Hq, Hk, T, D, torch.float32, torch.float32, strided)
    qo, ko = tri.forward(q, k, cos, sin)
    q0, k0 = rope_forward_ref(q, k, cos, sin)
    close(qo, q0, atol=1e-6, rtol=1e-6, name="q_out")  # two products and a sum in fp32
    close(ko, k0, atol=1e-6, rtol=1e-6, name="k_out")
    # backward = vector-Jacobian product of the reference forward
    qg = q.detach().clone().requires_grad_(True)
    kg = k.detach().clone().requires_grad_(True)
    dq = torch.randn_like(q0)
    dk = torch.randn_like(k0)
    q1, k1 = rope_forward_ref(qg, kg, cos, sin)
    torch.autograd.backward((q1, k1), (dq, dk))
    dqi, dki = tri.backward(dq, dk, cos, sin)
    close(dqi, qg.grad, atol=1e-6, rtol=1e-6, name="dq_in")
    close(dki, kg.grad, atol=1e-6, rtol=1e-6, name="dk_in")


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_bf16_against_fp32_oracle(close, table_dtype):
    q, k, cos, sin = _inputs(2, 4, 2, 5, 16, torch.bfloat16, table_dtype, strided=True)
    qo, ko = tri.forward(q, k, cos, sin)
    assert qo.dtype == torch.bfloat16 and ko.dtype == torch.bfloat16
    q0, k0 = rope_forward_ref(q.float(), k.float(), cos.float(), sin.float())
    # fp32 math on the same bf16 values, one rounding of the output: within 1 ulp
    assert_lowp_close(close, qo, q0, ulps=1, name="q_out")
    assert_lowp_close(close, ko, k0, ulps=1, name="k_out")


def test_batch_one_table_broadcasts(close):
    q, k, cos, sin = _inputs(3, 2, 2, 4, 8, torch.float32, torch.float32)
    cos1, sin1 = cos[:1], sin[:1]
    qo, ko = tri.forward(q, k, cos1, sin1)
    q0, k0 = rope_forward_ref(q, k, cos1.expand(3, -1, -1), sin1.expand(3, -1, -1))
    close(qo, q0, atol=1e-6, rtol=1e-6, name="q_out")
    close(ko, k0, atol=1e-6, rtol=1e-6, name="k_out")


def test_bad_table_shape_raises():
    q, k, cos, sin = _inputs(2, 2, 2, 4, 8, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="cos"):
        tri.forward(q, k, cos[:, :3], sin)
