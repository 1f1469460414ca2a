"""Mamba2's chunked scan against the fp64 token-by-token recurrence (the oracle) and transformers'
own torch functions (Granite 4's ``mamba2_chunk_scan`` and ``mamba2_selective_state_update``), per
packed example, with odd lengths and lengths that are not a multiple of the chunk; the op's
hand-written backward of every backend against autograd through the reference (gradcheck in fp64,
every gradient at fp32 1e-5), the C++ decoding step, and the op under torch.compile."""

import math

import pytest
import torch

from lorafuse import backends
from lorafuse.ops.mamba2_scan import mamba2_scan, mamba2_scan_recurrent, mamba2_scan_reference
from lorafuse.ops.mamba2_scan_chunks import torch_backward, torch_forward
from lorafuse.testing import needs_cpp, op_cases

CHUNK = 8
CASES = op_cases("mamba2_scan")


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


# ---- the op's own backward (every backend) against autograd through the reference ----------

NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")
# (batch, T, cu_seqlens, heads, groups, chunk): odd lengths, lengths not a multiple of the chunk,
# T = 1, several packed examples (one empty), G < H and G = 1.
SHAPES = [
    (2, 37, None, 4, 2, CHUNK),
    (1, 37, [0, 10, 10, 11, 37], 4, 2, CHUNK),
    (1, 1, None, 4, 1, CHUNK),
    (1, 29, [0, 5, 29], 6, 3, 4),
]


def _leaves(b, t, cu, h, g, dtype, seed=0):
    i = _inputs(b, t, h=h, g=g, dtype=dtype, seed=seed)
    n = b if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(seed + 1)
    i["initial_state"] = torch.randn(n, h, 3, 5, generator=gen, dtype=torch.float64).to(dtype)
    return {k: v.detach().clone().requires_grad_() for k, v in i.items()}


def _call(fn, i, cu, chunk, **kw):
    return fn(i["x"], i["dt"], i["A"], i["B"], i["C"], D=i["D"], dt_bias=i["dt_bias"],
              dt_softplus=True, dt_limit=(0.05, 3.0), chunk_size=chunk,
              initial_state=i["initial_state"], output_final_state=True,
              cu_seqlens=None if cu is None else torch.tensor(cu), **kw)  # fmt: skip


def _grads(fn, i, cu, chunk, seed=3, **kw):
    y, s = _call(fn, i, cu, chunk, **kw)
    gen = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype)
    gs = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    return y, s, torch.autograd.grad((y * gy).sum() + (s * gs).sum(), list(i.values()))


def _reference(*args, chunk_size, **kw):
    return mamba2_scan_reference(*args, chunk_size=chunk_size, **kw)


@pytest.mark.parametrize("backend, device", CASES)
def test_gradcheck_in_fp64(backend, device):
    # Packed examples (one empty), initial states with grad, the dt limits active (dt' is clamped
    # at both ends for some tokens), G < H, lengths that are not a multiple of the chunk; small
    # enough for gradcheck's two forward calls per input element (126 here).
    cu = torch.tensor([0, 3, 3, 7])
    i = {k: v.detach().requires_grad_() for k, v in _inputs(1, 7, h=2, p=2, g=1, n=3).items()}
    i["initial_state"] = torch.randn(3, 2, 2, 3, dtype=torch.float64, requires_grad=True)

    def f(x, dt, A, B, C, D, bias, s):
        return mamba2_scan(x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True,
                           dt_limit=(0.3, 1.5), chunk_size=2, initial_state=s,
                           output_final_state=True, cu_seqlens=cu, backend=backend)  # fmt: skip

    z = torch.nn.functional.softplus(i["dt"] + i["dt_bias"]).detach()
    assert bool((z < 0.3).any()) and bool((z > 1.5).any())  # both limits bind somewhere
    assert torch.autograd.gradcheck(f, tuple(i.values()))


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("b, t, cu, h, g, chunk", SHAPES)
def test_every_gradient_equals_autograd_through_the_reference_fp32(backend, device, b, t, cu, h,
                                                                    g, chunk, close):  # fmt: skip
    i = _leaves(b, t, cu, h, g, torch.float32)
    y, s, grads = _grads(mamba2_scan, i, cu, chunk, backend=backend)
    ref = _leaves(b, t, cu, h, g, torch.float32)
    ry, rs, oracle = _grads(_reference, ref, cu, chunk)
    close(y, ry, atol=1e-5, rtol=1e-5, name="y")
    close(s, rs, atol=1e-5, rtol=1e-5, name="final_state")
    for name, a, e in zip(NAMES, grads, oracle):
        # Sums over tokens (A, D, dt_bias) and over the state run in another order: 1e-5 of the
        # gradient's own scale.
        close(a, e, atol=1e-5 * e.abs().max().item(), rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_only_the_asked_gradients_come_back(backend, device):
    i = _leaves(1, 9, None, 4, 2, torch.float32)
    for k in ("A", "D", "dt_bias", "initial_state"):
        i[k].requires_grad_(False)
    y, s = _call(mamba2_scan, i, None, CHUNK, backend=backend)
    y.sum().backward()
    assert all(i[k].grad is None for k in ("A", "D", "dt_bias", "initial_state"))
    assert all(i[k].grad is not None for k in ("x", "dt", "B", "C"))


@pytest.mark.parametrize("backend, device", CASES)
def test_bf16_gradients_no_worse_than_transformers_against_the_oracle(backend, device):
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    names = ("x", "dt", "B", "C")
    base = _inputs(2, 37, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    gy = torch.randn(2, 37, 4, 3, generator=gen)

    def grads(fn, dtype):
        i = {k: v.to(dtype).requires_grad_(k in names) for k, v in base.items()}
        y = fn(i)
        return y, torch.autograd.grad((y.double() * gy.double()).sum(), [i[k] for k in names])

    ours = grads(lambda i: mamba2_scan(**i, dt_softplus=True, chunk_size=CHUNK,
                                       backend=backend)[0], torch.bfloat16)  # fmt: skip
    stock = grads(lambda i: mamba2_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], CHUNK,
                                              D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True),
                  torch.bfloat16)  # fmt: skip
    oracle = grads(lambda i: _rec(i)[0], torch.float64)
    for k, (a, s, e) in enumerate(zip((ours[0], *ours[1]), (stock[0], *stock[1]),
                                      (oracle[0], *oracle[1]))):  # fmt: skip
        err = lambda v, e=e: (v.double() - e).pow(2).mean().sqrt().item()  # noqa: E731
        assert err(a) <= err(s), ((("y",) + names)[k], err(a), err(s))


# ---- the C++ kernel: sub-chunks inside chunks, and the decoding step ------------------------


@needs_cpp
def test_cpp_sub_chunks_equal_the_torch_contract_in_fp64(close):
    # The kernel walks each chunk in sub-chunks (its BLAS product shape); 3 tokens each inside
    # chunks of 8, so chunks hold full and partial sub-chunks and examples end inside both.
    forward, backward = backends.compiled("mamba2_scan", "cpp", "forward", "backward")
    i = _leaves(1, 37, [0, 10, 10, 11, 37], 4, 2, torch.float64)
    args = (*i.values(), torch.tensor([0, 10, 10, 11, 37]), True, 0.05, 3.0, CHUNK)
    with torch.no_grad():
        ours = forward(*args, sub=3)
        theirs = torch_forward(*args)
        for name, a, e in zip(("y", "final", "saved"), ours, theirs):
            close(a, e, atol=1e-12, rtol=1e-12, name=name)
        gy, gs = torch.randn_like(ours[0]), torch.randn_like(ours[1])
        needs = (True,) * 8
        got = backward(gy, gs, *args[:9], ours[2], *args[9:], needs, sub=3)
        want = torch_backward(gy, gs, *args[:9], theirs[2], *args[9:], needs)
    for name, a, e in zip(NAMES, got, want):
        close(a, e, atol=1e-11 * e.abs().max().item(), rtol=1e-11, name=name)


@needs_cpp
@pytest.mark.parametrize("state, with_d, dtype", [(True, True, torch.float32),
                                                  (False, False, torch.float32),
                                                  (True, True, torch.bfloat16)])  # fmt: skip
def test_cpp_decoding_step_equals_the_recurrence(state, with_d, dtype, close):
    i = _inputs(3, 1, h=4, g=2, n=21, dtype=dtype, seed=2)  # N = 21: vectors and a ragged end
    if not with_d:
        i["D"] = None
    s0 = torch.randn(3, 4, 3, 21) if state else None
    kw = dict(dt_softplus=True, dt_limit=(0.05, 3.0), initial_state=s0, output_final_state=True)
    with torch.no_grad():
        y, s = mamba2_scan(**i, **kw, backend="cpp")
    ry, rs = mamba2_scan_recurrent(**{k: v.double() if v is not None else None
                                      for k, v in i.items()},
                                   **{**kw, "initial_state": None if s0 is None else s0.double()})  # fmt: skip
    assert y.dtype == s.dtype == torch.float32
    close(y, ry, atol=1e-5, rtol=1e-5, name="y")
    close(s, rs, atol=1e-5, rtol=1e-5, name="state")


def test_compiles_to_custom_op_nodes_without_graph_breaks(close):
    torch._dynamo.reset()
    backend = "cpp" if backends.cpp_available() else "torch"

    def f(i):  # packed examples: the boundaries' values are read inside the op only
        y, s = _call(mamba2_scan, i, [0, 10, 37], CHUNK, backend=backend)
        return (y * y).sum() + s.sum()

    i = _leaves(1, 37, [0, 10, 37], 4, 2, torch.float32)
    i2 = {k: v.detach().clone().requires_grad_() for k, v in i.items()}
    g = lambda fn, i: torch.autograd.grad(fn(i), list(i.values()))  # noqa: E731
    got = g(torch.compile(f, backend="aot_eager", fullgraph=True), i)
    want = g(f, i2)
    for name, a, e in zip(NAMES, got, want):
        close(a, e, atol=1e-6, rtol=1e-6, name=name)
    torch._dynamo.reset()
