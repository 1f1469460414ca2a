"""Numeric checks for fused ops: closeness with a useful report, the fp32 oracle, 'as accurate as stock', the fp32 sum bound, what autograd saved."""

from __future__ import annotations

import math

import torch


def assert_close(actual, expected, *, atol, rtol, name="tensor"):
    """Like torch.testing.assert_close, but the message says max/mean difference and where."""
    actual = actual.detach()
    expected = (
        expected.detach().to(actual.dtype) if expected.dtype != actual.dtype else expected.detach()
    )
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a = actual.double()
    e = expected.double()
    diff = (a - e).abs()
    bound = atol + rtol * e.abs()
    if bool(torch.isfinite(a).all()) and bool((diff <= bound).all()):
        return
    worst = int(torch.argmax(diff - bound).item()) if diff.numel() else 0
    where = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        if diff.numel()
        else ()
    )
    raise AssertionError(
        f"{name}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}, "
        f"worst at {where}: got {a.flatten()[worst].item():.6e}, expected {e.flatten()[worst].item():.6e} "
        f"(atol={atol}, rtol={rtol}); non-finite: {int((~torch.isfinite(a)).sum())}"
    )


def fp32_oracle(model):
    """An fp32 copy of ``model`` holding the same (already rounded) low-precision weights."""
    import copy

    return copy.deepcopy(model).float()


def assert_as_accurate_as_stock(ours, stock, oracle, *, name, close=None, factor=1.5):
    """Outputs of a lorafuse model (``ours``) vs stock transformers/PEFT on the same weights.

    fp32: equal up to summation order (1e-5). bf16/fp16: the two round at different points, so
    they are not compared with each other; each is compared with ``oracle`` (the fp32 model on the
    same rounded weights), and ours may be at most ``factor`` times as far from it as stock is
    (root-mean-square error over all elements: the max of a few thousand rounding errors is too
    noisy to compare with a ratio).
    """
    if ours.dtype == torch.float32:
        (close or assert_close)(ours, stock, atol=1e-5, rtol=1e-5, name=name)
        return
    assert oracle.dtype == torch.float32, oracle.dtype
    ours_err, stock_err = rms_error(ours, oracle), rms_error(stock, oracle)
    assert ours_err <= factor * stock_err, (
        f"{name}: ours is {ours_err:.3e} (rms) from the fp32 oracle, stock {stock_err:.3e}: "
        f"more than {factor}x"
    )


def rms_error(t: torch.Tensor, oracle: torch.Tensor) -> float:
    """Root-mean-square distance of ``t`` from ``oracle``, both read in fp32."""
    return float((t.float() - oracle.float()).pow(2).mean().sqrt())


def grad_fn_names(y: torch.Tensor, depth: int = 3) -> list[str]:
    """Names of the autograd nodes within ``depth`` steps of ``y`` (its grad_fn first): which
    Function a call went through."""
    names, frontier = [], [y.grad_fn]
    for _ in range(depth):
        frontier = [f for f in frontier if f is not None]
        names += [f.name() for f in frontier]
        frontier = [n for f in frontier for n, _ in f.next_functions]
    return names


def assert_close_to_fp32_oracle(y, grads, reference, inputs, g, tol: float) -> None:
    """``y`` and ``grads`` (those of the ``inputs`` that require grad, in order) against
    ``reference(*inputs)`` recomputed in fp32 (None inputs passed through), each within ``tol``
    of its own scale."""
    f = [t.detach().float().requires_grad_(t.requires_grad) if t is not None else None
         for t in inputs]  # fmt: skip
    ry = reference(*f)
    oracle = torch.autograd.grad(ry, [t for t in f if t is not None and t.requires_grad], g.float())
    assert_close(y, ry, atol=tol * ry.abs().max().item(), rtol=tol, name="y")
    for a, e in zip(grads, oracle):
        assert_close(a, e, atol=tol * e.abs().max().item(), rtol=tol, name="grad")


def saved_bytes(fn, params):
    """``(bytes, fn())``: bytes of the unique tensor storages autograd saves while running ``fn``,
    excluding the storages of ``params`` (weights are resident anyway; saving a reference to them
    costs nothing)."""
    resident = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in resident:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def within_fp32_sum_bound(y, x, w, bias=None) -> bool:
    """Whether ``y`` is ``x·wᵀ + bias`` summed in fp32 and rounded once to ``y``'s dtype: within
    fp32 summation's error bound (k·2⁻²⁴·Σ|x||w|, the bias one more term) plus one ulp of ``y``'s
    dtype, against the float64 product. NaN outputs must be where float64 has them."""
    x64, w64 = x.double(), w.double()
    b64 = torch.zeros(()) if bias is None else bias.double()
    expect = x64 @ w64.t() + b64
    magnitude = x64.abs() @ w64.abs().t() + b64.abs()
    info = torch.finfo(y.dtype)
    ulp = torch.exp2(
        torch.floor(torch.log2(expect.abs().clamp_min(info.tiny))) + math.log2(info.eps)
    )
    bound = ulp + (x.shape[-1] + 1) * 2.0**-24 * magnitude
    nan = expect.isnan()
    if not torch.equal(y.isnan(), nan):
        return False
    return bool(((y.double() - expect).abs() <= bound)[~nan].all())
