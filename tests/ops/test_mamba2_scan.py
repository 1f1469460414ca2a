"""Mamba2's chunked scan against the fp64 token-by-token recurrence (the oracle) and transformers'
own torch functions (Granite 4's ``mamba2_chunk_scan`` and ``mamba2_selective_state_update``), per
packed example, with odd lengths and lengths that are not a multiple of the chunk."""

import math

import pytest
import torch

from lorafuse.ops.mamba2_scan import mamba2_scan, mamba2_scan_recurrent, mamba2_scan_reference

CHUNK = 8


def _inputs(b, t, h=4, p=3, g=2, n=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    a = -(torch.rand(h, generator=gen, dtype=torch.float64) * 2 + 0.1).to(dtype)  # A < 0
    return dict(x=r(b, t, h, p), dt=r(b, t, h), A=a, B=r(b, t, g, n), C=r(b, t, g, n), D=r(h),
                dt_bias=r(h))  # fmt: skip


def _scan(fn, i, **kw):
    return fn(i["x"], i["dt"], i["A"], i["B"], i["C"], D=i["D"], dt_bias=i["dt_bias"],
              dt_softplus=True, **kw)  # fmt: skip


def _ref(i, **kw):
    return _scan(lambda *a, **k: mamba2_scan_reference(*a, chunk_size=CHUNK, **k), i, **kw)


def _rec(i, **kw):
    return _scan(mamba2_scan_recurrent, i, **kw)


@pytest.mark.parametrize("t", [1, 7, 8, 9, 37])
def test_chunked_equals_recurrence_in_fp64(t, close):
    i = _inputs(2, t)
    state = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    kw = dict(initial_state=state, output_final_state=True, dt_limit=(0.05, 3.0))
    (y, s), (y_ref, s_ref) = _ref(i, **kw), _rec(i, **kw)
    close(y, y_ref, atol=1e-12, rtol=1e-12)
    close(s, s_ref, atol=1e-12, rtol=1e-12)


def test_equals_transformers_chunk_scan_and_state_update(close):
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        mamba2_chunk_scan,
        mamba2_selective_state_update,
    )

    i = _inputs(2, 37, dtype=torch.float32)
    state = torch.randn(2, 4, 3, 5)
    y, s = mamba2_scan(**i, dt_softplus=True, chunk_size=CHUNK, initial_state=state,
                       output_final_state=True, dt_limit=(0.05, 3.0))  # fmt: skip
    y_hf, s_hf = mamba2_chunk_scan(
        i["x"], i["dt"], i["A"], i["B"], i["C"], CHUNK, D=i["D"], dt_bias=i["dt_bias"],
        initial_states=state, dt_softplus=True, dt_limit=(0.05, 3.0), return_final_states=True,
    )  # fmt: skip
    close(y, y_hf, atol=1e-5, rtol=1e-5)
    close(s, s_hf, atol=1e-5, rtol=1e-5)
    # One decoding step from that state (T = 1: the recurrence), as the layer calls the update.
    one = _inputs(2, 1, dtype=torch.float32, seed=1)
    y1, s1 = mamba2_scan(**one, dt_softplus=True, initial_state=s, output_final_state=True)
    per_p = lambda v: v[..., None].expand(*v.shape, 3)  # noqa: E731 - (.., H) -> (.., H, P)
    hf_state = s_hf.clone()
    y1_hf = mamba2_selective_state_update(
        hf_state, one["x"][:, 0], per_p(one["dt"][:, 0]), per_p(one["A"])[..., None].expand(
            -1, -1, 5), one["B"][:, 0], one["C"][:, 0], per_p(one["D"]),
        dt_bias=per_p(one["dt_bias"]), dt_softplus=True,
    )  # fmt: skip
    close(y1[:, 0], y1_hf, atol=1e-5, rtol=1e-5)
    close(s1, hf_state, atol=1e-5, rtol=1e-5)


def test_packed_examples_restart_the_state(close):
    i = _inputs(1, 37)
    cu = torch.tensor([0, 10, 10, 11, 37])  # an empty example too
    state = torch.randn(4, 4, 3, 5, dtype=torch.float64)
    y, s = _ref(i, cu_seqlens=cu, initial_state=state, output_final_state=True)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {k: v[:, a:b] if v.dim() > 1 else v for k, v in i.items()}
        alone, s_alone = _rec(part, initial_state=state[n : n + 1], output_final_state=True)
        close(y[:, a:b], alone, atol=1e-12, rtol=1e-12)
        close(s[n], s_alone[0], atol=1e-12, rtol=1e-12)


def test_gradients_equal_the_fp64_recurrence(close):
    i32 = {k: v.requires_grad_() for k, v in _inputs(1, 21, dtype=torch.float32).items()}
    s32 = torch.randn(2, 4, 3, 5, requires_grad=True)
    cu = torch.tensor([0, 13, 21])
    y, s = _ref(i32, cu_seqlens=cu, initial_state=s32, output_final_state=True)
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    leaves = [*i32.values(), s32]
    grads = torch.autograd.grad((y * gy).sum() + (s * gs).sum(), leaves)
    i64 = {k: v.detach().double().requires_grad_() for k, v in i32.items()}
    s64 = s32.detach().double().requires_grad_()
    y64, s64_out = _rec(i64, cu_seqlens=cu, initial_state=s64, output_final_state=True)
    oracle = torch.autograd.grad(
        (y64 * gy.double()).sum() + (s64_out * gs.double()).sum(), [*i64.values(), s64]
    )
    close(y, y64, atol=1e-5, rtol=1e-5)
    for name, a, e in zip([*i32, "initial_state"], grads, oracle):
        close(a, e, atol=1e-5 * e.abs().max().item(), rtol=1e-5, name=name)


def test_bf16_no_worse_than_transformers_against_the_fp32_oracle():
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    i = _inputs(2, 37, dtype=torch.bfloat16)
    oracle, _ = _rec({k: v.double() for k, v in i.items()})
    ours, _ = mamba2_scan(**i, dt_softplus=True, chunk_size=CHUNK)
    stock = mamba2_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], CHUNK, D=i["D"],
                              dt_bias=i["dt_bias"], dt_softplus=True)  # fmt: skip
    err_ours = (ours.double() - oracle).abs().max().item()
    err_stock = (stock.double() - oracle).abs().max().item()
    assert err_ours <= err_stock, (err_ours, err_stock)


def test_bad_inputs_name_them():
    i = _inputs(2, 8)
    with pytest.raises(ValueError, match="multiple of G"):
        mamba2_scan(i["x"], i["dt"], i["A"], i["B"][:, :, :1].expand(-1, -1, 3, -1), i["C"])
    with pytest.raises(ValueError, match="cu_seqlens"):
        mamba2_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="initial_state"):
        mamba2_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], initial_state=torch.zeros(1, 4, 3, 5))
    with pytest.raises(ValueError, match="dt_bias"):
        mamba2_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], dt_bias=torch.zeros(3))
    assert math.isinf(mamba2_scan.__kwdefaults__["dt_limit"][1])
