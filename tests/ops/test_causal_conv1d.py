"""Causal depthwise conv1d: the reference against transformers' own function, per packed example,
continued from a decoding state; the autograd.Function's hand-written backward against autograd
through the reference, on every backend."""

import pytest
import torch

from lorafuse.ops.causal_conv1d import causal_conv1d, causal_conv1d_reference
from lorafuse.testing import assert_as_accurate_as_stock, assert_close, op_cases


def _inputs(b=2, d=12, t=37, k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, d, t, generator=gen), torch.randn(d, k, generator=gen),
            torch.randn(d, generator=gen))  # fmt: skip


@pytest.mark.parametrize("activation", [None, "silu"])
def test_equals_transformers_causal_conv1d_fn(activation):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, w, b = _inputs()
    y, _ = causal_conv1d(x, w, b, activation=activation)
    torch.testing.assert_close(y, causal_conv1d_fn(x, w, b, activation=activation))


@pytest.mark.parametrize(
    "backend", ["reference", *(c.values[0] for c in op_cases("causal_conv1d"))]
)
def test_packed_examples_restart_the_window(backend):
    x, w, b = _inputs(b=1)
    cu = torch.tensor([0, 10, 11, 37])

    def run(x, **kw):
        if backend == "reference":
            return causal_conv1d_reference(x, w, b, "silu", None, True, kw.get("cu_seqlens"))
        return causal_conv1d(x, w, b, activation="silu", output_final_state=True, backend=backend,
                             **kw)  # fmt: skip

    y, final = run(x, cu_seqlens=cu)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone, f = run(x[:, :, s:e])
        assert torch.equal(final[i], f[0])
        if backend == "torch":  # all examples in one tensor: torch's vectorised exp (silu) and its
            # scalar tail differ in the last bit, so a value may differ by an ulp; a state leaking
            # across the boundary differs by O(1)
            assert_close(y[:, :, s:e], alone, atol=0, rtol=2e-7, name="y")
        else:
            assert torch.equal(y[:, :, s:e], alone)


def test_decoding_state_continues_the_sequence():
    x, w, b = _inputs(b=1)
    y_all, _ = causal_conv1d(x, w, b, activation="silu")
    y1, state = causal_conv1d(x[:, :, :20], w, b, activation="silu", output_final_state=True)
    y2, _ = causal_conv1d(x[:, :, 20:], w, b, activation="silu", initial_state=state)
    torch.testing.assert_close(torch.cat([y1, y2], -1), y_all)


# ---- the autograd.Function (hand-written backward), every backend -----------------------------

CASES = op_cases("causal_conv1d")
# (B, D, T, K, cu_seqlens): odd sizes (D not a multiple of the vector width), one token, packed
# examples one of which is shorter than the kernel, LFM2's K = 3.
SHAPES = [
    (2, 37, 19, 4, None),
    (3, 20, 1, 4, None),
    (1, 24, 41, 4, (0, 10, 12, 13, 41)),
    (1, 17, 9, 3, (0, 4, 9)),
]


def _run(fn, x, w, b, state, dy, dfinal, **kw):
    leaves = [
        None if t is None else t.detach().clone().requires_grad_(True) for t in (x, w, b, state)
    ]
    y, final = fn(*leaves[:3], initial_state=leaves[3], output_final_state=True, **kw)
    loss = (y.float() * dy).sum() + (final.float() * dfinal).sum()
    return y, final, torch.autograd.grad(loss, [t for t in leaves if t is not None])


def _reference(x, w, b, *, initial_state, output_final_state, activation, cu_seqlens):
    return causal_conv1d_reference(
        x, w, b, activation, initial_state, output_final_state, cu_seqlens
    )


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("b, d, t, k, cu", SHAPES)
@pytest.mark.parametrize("activation, bias", [("silu", True), (None, False)])
def test_function_fp32_equals_autograd_through_the_reference(
    backend, device, b, d, t, k, cu, activation, bias
):
    gen = torch.Generator().manual_seed(t)
    cu = None if cu is None else torch.tensor(cu)
    n = b if cu is None else len(cu) - 1
    x, w = torch.randn(b, d, t, generator=gen), torch.randn(d, k, generator=gen)
    bias_t = torch.randn(d, generator=gen) if bias else None
    state = torch.randn(n, d, k - 1, generator=gen)
    dy, dfinal = torch.randn(b, d, t, generator=gen), torch.randn(n, d, k - 1, generator=gen)
    kw = {"activation": activation, "cu_seqlens": cu}
    ours = _run(lambda *a, **k: causal_conv1d(*a, **k, backend=backend), x, w, bias_t, state, dy,
                dfinal, **kw)  # fmt: skip
    ref = _run(_reference, x, w, bias_t, state, dy, dfinal, **kw)
    assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5, name="y")
    assert_close(ours[1], ref[1], atol=0, rtol=0, name="final_state")
    names = ("dx", "dweight", "dbias", "dstate") if bias else ("dx", "dweight", "dstate")
    for name, got, want in zip(names, ours[2], ref[2]):
        assert_close(got, want, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_channels_last_input(backend, device, close):
    # The models hand over in_proj's output transposed: (B, D, T) with channels adjacent.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 23, 30, generator=gen)  # (B, T, D)
    w, b = torch.randn(30, 4, generator=gen), torch.randn(30, generator=gen)
    xt = x.transpose(1, 2).requires_grad_(True)  # (B, D, T) view
    y, _ = causal_conv1d(xt, w, b, activation="silu", backend=backend)
    want = causal_conv1d_reference(x.transpose(1, 2).contiguous(), w, b, "silu")[0]
    close(y, want, atol=1e-5, rtol=1e-5)
    (dx,) = torch.autograd.grad(y.sum(), xt)
    xc = x.transpose(1, 2).contiguous().requires_grad_(True)
    (dx_ref,) = torch.autograd.grad(causal_conv1d_reference(xc, w, b, "silu")[0].sum(), xc)
    close(dx, dx_ref, atol=1e-5, rtol=1e-5)


def test_gradcheck_fp64():
    gen = torch.Generator().manual_seed(1)
    x, w, b = (
        torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((1, 3, 7), (3, 4), (3,))
    )
    state = torch.randn(2, 3, 3, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 2, 7])

    def f(x, w, b, state):
        return causal_conv1d(x, w, b, activation="silu", initial_state=state,
                             output_final_state=True, cu_seqlens=cu, backend="torch")  # fmt: skip

    assert torch.autograd.gradcheck(f, [t.requires_grad_(True) for t in (x, w, b, state)])


@pytest.mark.parametrize("backend, device", CASES)
def test_bf16_as_accurate_as_transformers(backend, device):
    """bf16 x, weight and bias against the fp32 oracle on the same rounded values: ours no further
    from it than transformers' causal_conv1d_fn in bf16."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, w, b = (t.bfloat16() for t in _inputs(b=2, d=40, t=33))
    dy = torch.randn(2, 40, 33, generator=torch.Generator().manual_seed(5))

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, w, b)]
        y = fn(*leaves)
        return (y.detach(), *torch.autograd.grad((y.float() * dy).sum(), leaves))

    ours = run(lambda *a: causal_conv1d(*a, activation="silu", backend=backend)[0], torch.bfloat16)
    stock = run(lambda *a: causal_conv1d_fn(*a, activation="silu"), torch.bfloat16)
    oracle = run(lambda *a: causal_conv1d_reference(*a, "silu")[0], torch.float32)
    for name, a, s, o in zip(("y", "dx", "dweight", "dbias"), ours, stock, oracle):
        assert a.dtype == s.dtype, name
        assert_as_accurate_as_stock(a, s, o, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_decoding_one_token_at_a_time(backend, device, close):
    x, w, b = _inputs(b=2, d=19, t=12)
    y_all, _ = causal_conv1d_reference(x, w, b, "silu")
    with torch.no_grad():
        y, state = causal_conv1d(x[:, :, :8], w, b, activation="silu", output_final_state=True,
                                 backend=backend)  # fmt: skip
        outs = [y]
        for i in range(8, 12):
            y, state = causal_conv1d(x[:, :, i : i + 1], w, b, activation="silu",
                                     initial_state=state, output_final_state=True,
                                     backend=backend)  # fmt: skip
            outs.append(y)
    close(torch.cat(outs, -1), y_all, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend, device", CASES)
def test_autocast_keeps_fp32_math(backend, device):
    x, w, b = (t.requires_grad_(True) for t in _inputs())
    y, _ = causal_conv1d(x, w, b, activation="silu", backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ac, _ = causal_conv1d(x, w, b, activation="silu", backend=backend)
    assert y_ac.dtype == torch.float32 and torch.equal(y, y_ac)


# ---- torch.compile: the custom op -------------------------------------------------------------


@pytest.mark.parametrize("backend", [c.values[0] for c in CASES if c.values[1] == "cpu"])
def test_compiles_without_graph_breaks_and_equals_eager(backend):
    from lorafuse.ops import causal_conv1d as op

    torch._dynamo.reset()
    x, w, b = _inputs(b=1, d=12, t=21)
    state = torch.randn(3, 12, 3, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 5, 6, 21])

    def f(x, w, b, state):
        y, final = causal_conv1d(x, w, b, activation="silu", initial_state=state,
                                 output_final_state=True, cu_seqlens=cu, backend=backend)  # fmt: skip
        return (y * y).sum() + final.sum()

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b, state)]
        loss = fn(*leaves)
        return loss, torch.autograd.grad(loss, leaves)

    exp = torch._dynamo.explain(f)(x, w, b, state)
    assert exp.graph_break_count == 0, [r.reason for r in exp.break_reasons]
    names = {str(n.target) for g in exp.graphs for n in g.graph.nodes}
    assert "lorafuse.causal_conv1d.default" in names, names
    loss, grads = run(f)
    loss_c, grads_c = run(torch.compile(f, backend="aot_eager", fullgraph=True))
    assert_close(loss_c, loss, atol=1e-5, rtol=1e-6, name="loss")
    for a, c in zip(grads_c, grads):
        assert_close(a, c, atol=1e-6, rtol=1e-6, name="grad")
    torch._dynamo.reset()
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b, state)]
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op.causal_conv1d_op, (*leaves, "silu", cu, 3, backend),
                          test_utils=(*checks, "test_aot_dispatch_dynamic"))  # fmt: skip
    torch.library.opcheck(op.causal_conv1d_backward_op,
                          (torch.randn(1, 12, 21), torch.randn(3, 12, 3), x, w, b, "silu", state,
                           cu, 3, [True, True, True, True], backend), test_utils=checks)  # fmt: skip
