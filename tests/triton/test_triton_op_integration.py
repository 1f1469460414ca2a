"""The public ops with backend='triton' equal backend='torch' through autograd (fp32).

The kernel tests check each Triton function against its torch reference; these check the wiring: the
op's autograd Function hands the Triton kernels what they expect and routes the gradients back.
"""

from __future__ import annotations

import pytest
import torch
from tritonlib import DEVICE, interpret_on_cpu  # noqa: F401  (fixture)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]

# fp32 on both paths: only the order of the fp32 sums differs (tens of terms of O(1) size)
TOL = dict(atol=2e-5, rtol=1e-5)


def _leaves(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(DEVICE).requires_grad_(True) for s in shapes]


def _run_both(fn, leaves):
    """``fn(*inputs, backend)`` on fresh copies of ``leaves`` per backend: outputs and gradients."""
    results = {}
    for backend in ("torch", "triton"):
        inputs = [t.detach().clone().requires_grad_(True) for t in leaves]
        outs = fn(*inputs, backend)
        outs = outs if isinstance(outs, tuple) else (outs,)
        weights = [torch.linspace(-1, 1, o.numel(), device=DEVICE).reshape(o.shape) for o in outs]
        sum((o * w).sum() for o, w in zip(outs, weights)).backward()
        results[backend] = [*outs, *(t.grad for t in inputs)]
    return results["triton"], results["torch"]


def _compare(close, got, ref, names):
    for name, a, e in zip(names, got, ref):
        assert (a is None) == (e is None), name
        if e is not None:
            close(a, e, **TOL, name=name)


def test_rms_norm_op(close):
    from lorafuse.ops.rms_norm import rms_norm

    x, w = _leaves((2, 5, 37), (37,))
    got, ref = _run_both(lambda x, w, b: rms_norm(x, w, 1e-6, backend=b), [x, w])
    _compare(close, got, ref, ("y", "dx", "dw"))


def test_swiglu_op(close):
    from lorafuse.ops.swiglu import swiglu

    gate, up = _leaves((3, 4, 29), (3, 4, 29))
    got, ref = _run_both(lambda g, u, b: swiglu(g, u, backend=b), [gate, up])
    _compare(close, got, ref, ("h", "dgate", "dup"))


def test_rope_op_with_transposed_inputs(close):
    from lorafuse.ops.rope import apply_rope

    q, k = _leaves((2, 5, 4, 16), (2, 5, 2, 16))  # (B, T, H, D): transposed below, as HF does
    ang = torch.rand(1, 5, 16, device=DEVICE) * 6
    cos, sin = ang.cos(), ang.sin()

    def fn(q, k, b):
        return apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, backend=b)

    got, ref = _run_both(fn, [q, k])
    _compare(close, got, ref, ("q_out", "k_out", "dq", "dk"))


def test_fused_linear_cross_entropy_op(close):
    from lorafuse.ops.cross_entropy import fused_linear_cross_entropy

    hidden, weight = _leaves((13, 24), (50, 24))
    targets = torch.randint(0, 50, (13,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    targets[3] = -100

    def fn(h, w, b):
        return fused_linear_cross_entropy(h, w, targets, chunk_size=5, backend=b)

    got, ref = _run_both(fn, [hidden, weight])
    _compare(close, got, ref, ("loss", "dhidden", "dweight"))
