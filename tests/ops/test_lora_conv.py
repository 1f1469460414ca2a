"""lora_conv2d against the autograd reference (a kohya LoRA conv module's math), every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops.lora_conv import LoRAConv2dFunction, lora_conv2d, lora_conv2d_reference
from lorafuse.testing import (
    assert_close,
    assert_close_to_fp32_oracle,
    grad_fn_names,
    needs_cpp,
    op_cases,
)

CASES = op_cases("lora_conv2d")
# bf16 per CPU branch (conftest's cpu_low_precision): only the C++ kernel reads it, so only the
# cpp cases run both branches
LOW_CASES = [
    pytest.param(*case.values, branch, marks=case.marks, id=f"{case.id}-{branch}")
    for case in CASES
    for branch in (("native", "emulated") if case.values[0] == "cpp" else ("native",))
]
# (Cin, Cout, kernel, stride, padding, groups, (H, W)): odd sizes, 1x1 (proj_in/out, shortcuts),
# 3x3 same-size (ResNet convs), 3x3 stride 2 (Downsample2D), stride 2 without padding, groups.
GEOMETRIES = [
    (7, 13, 1, 1, 0, 1, (9, 11)),
    (5, 6, 3, 1, 1, 1, (13, 7)),
    (6, 10, 3, 2, 1, 1, (9, 8)),
    (6, 4, 3, 2, 0, 2, (10, 13)),
]


pytestmark = pytest.mark.usefixtures("ieee_fp32_convs")  # tests/conftest.py


def _setup(geometry, r, bias, dtype, adapter_dtype=None, n=2, seed=0, device="cpu"):
    cin, cout, k, _, _, groups, (h, w) = geometry
    gen = torch.Generator().manual_seed(seed)
    ad = adapter_dtype or dtype
    fan = cin // groups * k * k

    def rn(*shape, std=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * std).to(device, dt)

    x = rn(n, cin, h, w).requires_grad_(True)
    weight = rn(cout, cin // groups, k, k, std=fan**-0.5)  # outputs O(1): atol means something
    b = rn(cout, std=0.1).requires_grad_(True) if bias else None
    down = rn(r, cin, k, k, std=(cin * k * k) ** -0.5, dt=ad).requires_grad_(True)
    up = rn(cout, r, 1, 1, std=r**-0.5, dt=ad).requires_grad_(True)
    return x, weight, b, down, up


def _leaves(x, b, down, up):
    return [t for t in (x, b, down, up) if t is not None]


def _run(fn, x, weight, b, down, up, geometry, g=None, **kw):
    """Output and gradients of the leaves for grad ``g`` (drawn from the output's shape)."""
    _, _, _, stride, padding, groups, _ = geometry
    y = fn(x, weight, b, down, up, 1.5, stride, padding, 1, groups, **kw)
    if g is None:
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    return y, torch.autograd.grad(y, _leaves(x, b, down, up), g), g


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
# rank and bias paired (each rank once, bias on and off per geometry) to halve the grid's time
@pytest.mark.parametrize("r, bias", [(1, True), (8, False), (16, True)])
def test_lora_conv2d_fp32(backend, device, geometry, r, bias):
    x, weight, b, down, up = _setup(geometry, r, bias, torch.float32, device=device)
    y, got, g = _run(lora_conv2d, x, weight, b, down, up, geometry, backend=backend)
    ry, want, _ = _run(lora_conv2d_reference, x, weight, b, down, up, geometry, g)
    # fp32 vs fp32 autograd, different association only; sums over <= 7·9·2·13·11 terms of O(1)
    # -> 1e-5 relative with a floor at 1e-5 of each tensor's scale for entries that cancel.
    assert_close(y, ry, atol=1e-5 * ry.abs().max().item(), rtol=1e-5, name="y")
    names = ("dx", "db", "d_down", "d_up") if bias else ("dx", "d_down", "d_up")
    for name, a, e in zip(names, got, want):
        assert_close(a, e, atol=1e-5 * e.abs().max().item(), rtol=1e-5, name=name)


@pytest.mark.parametrize(
    "backend, device, cpu_low_precision", LOW_CASES, indirect=["cpu_low_precision"]
)
@pytest.mark.parametrize("adapter", ["bf16", "fp32"])
# 3x3 (the conv path) and 1x1 (the torch backend's matrix-product path, ops.lora_conv._pointwise)
@pytest.mark.parametrize("geometry", [(16, 12, 3, 1, 1, 1, (9, 7)), (16, 12, 1, 1, 0, 1, (9, 7))])
def test_lora_conv2d_bf16_against_fp32_oracle(
    backend, device, adapter, geometry, cpu_low_precision
):
    ad = torch.bfloat16 if adapter == "bf16" else torch.float32
    x, weight, b, down, up = _setup(geometry, 8, True, torch.bfloat16, ad, device=device)
    y, got, g = _run(lora_conv2d, x, weight, b, down, up, geometry, backend=backend)
    assert y.dtype == torch.bfloat16
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, ad, ad]
    f = [t.detach().float().requires_grad_(True) for t in (x, b, down, up)]
    ry, want, _ = _run(lora_conv2d_reference, f[0], weight.float(), *f[1:], geometry, g.float())
    # The same bf16 inputs, every step in fp32 for the oracle. The op rounds the base conv's
    # output (2^-9 relative), t (the rank-8 activation) and the summed output: <= 3 roundings
    # in y; gradients see <= 3 too (gt, each conv-transpose term, the sum). 3·2^-9 = 6e-3 of a
    # tensor's scale, plus sums of up to 16·9 rounded products whose errors partly cancel:
    # 2e-2 of each tensor's scale bounds it with room (fp32 adapters are tighter).
    assert_close(y, ry, atol=2e-2 * ry.abs().max().item(), rtol=2e-2, name="y")
    for name, a, e in zip(("dx", "db", "d_down", "d_up"), got, want):
        assert_close(a, e, atol=2e-2 * e.abs().max().item(), rtol=2e-2, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_lora_conv2d_autocast_matches_stock_autocast(backend, device):
    """Under autocast (bf16) the op casts what autocast casts for the three convs."""
    geometry = (8, 10, 3, 2, 1, 1, (9, 10))
    x, weight, b, down, up = _setup(geometry, 4, True, torch.float32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y, got, g = _run(lora_conv2d, x, weight, b, down, up, geometry, backend=backend)
        ry, want, _ = _run(lora_conv2d_reference, x, weight, b, down, up, geometry, g)
    assert y.dtype == ry.dtype == torch.bfloat16
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32] * 4
    # Both run bf16 convs on the same bf16-rounded operands; stock rounds each of its three
    # conv outputs, the scaled term and the sum to bf16 (<= 5 roundings of 2^-9), the op fewer:
    # 2e-2 of each tensor's scale bounds the difference between the two.
    assert_close(y, ry, atol=2e-2 * ry.abs().max().item(), rtol=2e-2, name="y")
    for name, a, e in zip(("dx", "db", "d_down", "d_up"), got, want):
        assert_close(a, e, atol=2e-2 * e.abs().max().item(), rtol=2e-2, name=name)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("geometry", [(6, 9, 3, 1, 1, 1, (7, 5)), (6, 9, 1, 1, 0, 1, (7, 5))])
def test_lora_conv2d_channels_last_and_unbatched(backend, device, geometry):
    x, weight, b, down, up = _setup(geometry, 4, True, torch.float32, device=device)
    xcl = x.detach().to(memory_format=torch.channels_last).requires_grad_(True)
    y, got, g = _run(lora_conv2d, xcl, weight, b, down, up, geometry, backend=backend)
    ry, want, _ = _run(lora_conv2d_reference, x, weight, b, down, up, geometry, g)
    assert_close(y, ry, atol=1e-5, rtol=1e-5, name="y (channels last)")
    for name, a, e in zip(("dx", "db", "d_down", "d_up"), got, want):
        assert_close(a, e, atol=1e-5 * e.abs().max().item(), rtol=1e-5, name=name)
    x1 = x[0].detach()  # (Cin, H, W): nn.Conv2d accepts unbatched input, so does the op
    pad = geometry[4]
    y1 = lora_conv2d(x1, weight, b, down, up, 1.5, 1, pad, backend=backend)
    ry1 = lora_conv2d_reference(x1[None], weight, b, down, up, 1.5, 1, pad)[0]
    assert_close(y1, ry1, atol=1e-5, rtol=1e-5, name="y (unbatched)")


@pytest.mark.parametrize("k", [3, 1])
def test_lora_conv2d_saves_bf16_input_once_never_an_fp32_copy(k):
    """fp32 adapters on a bf16 base: x is saved once as bf16, no (N, Cin, H, W) fp32 copy."""
    geometry = (8, 6, k, 1, k // 2, 1, (5, 6))
    x, weight, b, down, up = _setup(geometry, 4, False, torch.bfloat16, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lora_conv2d(x, weight, b, down, up, 1.0, 1, k // 2, backend="torch")
    big = [t for t in saved if tuple(t.shape) == tuple(x.shape)]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr(), "x must be saved exactly once"
    # besides x: the frozen weight and the adapters (no copies) and t (N, r, H', W'), nothing else
    shapes = sorted((tuple(t.shape), str(t.dtype)) for t in saved if t is not big[0])
    bf16, fp32 = str(torch.bfloat16), str(torch.float32)
    assert shapes == sorted(
        [((6, 8, k, k), bf16), ((4, 8, k, k), fp32), ((6, 4, 1, 1), fp32), ((2, 4, 5, 6), fp32)]
    )
    y.backward(torch.ones_like(y))


def test_lora_conv2d_frozen_bias_and_base_get_no_grad():
    geometry = (4, 5, 3, 1, 1, 1, (6, 6))
    x, weight, _, down, up = _setup(geometry, 2, False, torch.float32)
    b = torch.zeros(5)
    lora_conv2d(x, weight, b, down, up, 1.0, 1, 1).sum().backward()
    assert b.grad is None and weight.grad is None and down.grad is not None


def test_lora_conv2d_refuses_trainable_base_weight():
    geometry = (4, 5, 3, 1, 1, 1, (6, 6))
    x, weight, b, down, up = _setup(geometry, 2, False, torch.float32)
    with pytest.raises(ValueError, match="frozen"):
        lora_conv2d(x, weight.clone().requires_grad_(True), b, down, up, 1.0, 1, 1)
    with torch.no_grad():  # inference with a trainable weight is fine: no gradient is dropped
        lora_conv2d(x, weight.clone().requires_grad_(True), b, down, up, 1.0, 1, 1)


def test_lora_conv2d_errors_name_the_problem():
    geometry = (4, 5, 3, 1, 1, 1, (6, 6))
    x, w, b, down, up = _setup(geometry, 2, False, torch.float32)
    with pytest.raises(ValueError, match=r"weight must be \(Cout, 4/groups, kh, kw\)"):
        lora_conv2d(x, w[:, :3], b, down, up)
    with pytest.raises(ValueError, match=r"lora_down must be \(r, 4, 3, 3\)"):
        lora_conv2d(x, w, b, down[:, :, :1, :1], up)
    with pytest.raises(ValueError, match=r"lora_up must be \(5, 2, 1, 1\)"):
        lora_conv2d(x, w, b, down, up[:, :1])
    with pytest.raises(ValueError, match=r"bias must be \(5,\)"):
        lora_conv2d(x, w, torch.zeros(4), down, up)
    with pytest.raises(ValueError, match="input dtype torch.float64"):
        lora_conv2d(x.double(), w, b, down, up)
    with pytest.raises(ValueError, match="dtypes differ"):
        lora_conv2d(x, w, b, down, up.double())
    with pytest.raises(ValueError, match="too small"):
        lora_conv2d(x[:, :, :2, :2], w, b, down, up)
    with pytest.raises(ValueError, match="padding must be an int or a pair"):
        lora_conv2d(x, w, b, down, up, padding="same")
    with pytest.raises(ValueError, match=r"x must be \(N, Cin, H, W\)"):
        lora_conv2d(x[0, 0], w, b, down, up)


@pytest.mark.cpp
def test_cpp_kernel_refuses_mismatched_shapes():
    """The C++ entry points check their own contract (a caller other than the op gets a clear
    error naming the shapes, not a crash)."""
    import shutil

    from lorafuse import _ext

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine")
    ext = _ext.load_cpp()  # a build error here is a test error, never a skip
    x, w, b, down, up = (
        t.detach() for t in _setup((4, 5, 3, 1, 1, 1, (6, 6)), 2, True, torch.float32)
    )
    geo = ([1, 1], [1, 1], [1, 1], 1)
    with pytest.raises(RuntimeError, match="lora_up"):
        ext.lora_conv2d_forward(x, w, b, down, up[:, :1].contiguous(), 1.0, *geo)
    with pytest.raises(RuntimeError, match="groups=2"):
        ext.lora_conv2d_forward(x, w, b, down, up, 1.0, *geo[:3], 2)
    y, t = ext.lora_conv2d_forward(x, w, b, down, up, 1.0, *geo)
    with pytest.raises(RuntimeError, match="grad_output"):
        ext.lora_conv2d_backward(y[:, :2], x, w, down, up, t, 1.0, *geo, (True,) * 4)


# ---- the C++ autograd fast path (csrc/lora_autograd.cpp) ---------------------------------------


FAST = "torch::autograd::CppNode<lorafuse::LoRAConv2dFunction>"
POINTWISE, STRIDED = (8, 10, 1, 1, 0, 1, (5, 7)), (6, 10, 3, 2, 1, 1, (9, 8))


def _python_function(x, weight, b, down, up, geometry):
    """The same call through the Python autograd.Function (what the fast path replaces)."""
    _, _, _, stride, padding, groups, _ = geometry
    geo = ((stride, stride), (padding, padding), (1, 1), groups)
    return LoRAConv2dFunction.apply(x, weight, b, down, up, 1.5, geo, "cpp")


@pytest.mark.parametrize(
    "dtype, adapter, cpu_low_precision",
    [
        ("fp32", "fp32", "native"),
        ("bf16", "bf16", "native"),
        ("bf16", "bf16", "emulated"),
        ("bf16", "fp32", "native"),
    ],  # fmt: skip
    indirect=["cpu_low_precision"],
)
@pytest.mark.parametrize("geometry", [POINTWISE, STRIDED], ids=["1x1", "3x3s2"])
@pytest.mark.parametrize("bias, x_grad", [(True, True), (False, False)])
@needs_cpp
def test_lora_conv2d_fast_path_equals_python_function_bit_for_bit(
    dtype, adapter, cpu_low_precision, geometry, bias, x_grad
):
    """Same kernels, so the same bits as the Python Function: output and every gradient; and the
    reference within the op's tolerances. The 1x1 case with one image (the UNet's batch of 1
    takes the kernels' single-mm branch), the 3x3 with two."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    n = 1 if geometry is POINTWISE else 2
    x, weight, b, down, up = _setup(geometry, 4, bias, dt[dtype], dt[adapter], n=n)
    x.requires_grad_(x_grad)
    leaves = [t for t in _leaves(x, b, down, up) if t.requires_grad]
    _, _, _, stride, padding, groups, _ = geometry
    y = lora_conv2d(x, weight, b, down, up, 1.5, stride, padding, 1, groups, backend="cpp")
    assert grad_fn_names(y)[0] == FAST
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    py = _python_function(x, weight, b, down, up, geometry)
    assert "LoRAConv2dFunctionBackward" in grad_fn_names(py)
    got = torch.autograd.grad(y, leaves, g)
    want = torch.autograd.grad(py, leaves, g)
    assert y.dtype == py.dtype and torch.equal(y, py)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e)
    # fp32: different association only (1e-5, as test_lora_conv2d_fp32); bf16: as
    # test_lora_conv2d_bf16_against_fp32_oracle (<= 3 roundings of 2^-9 -> 2e-2 of the scale).
    tol = 1e-5 if dtype == "fp32" else 2e-2
    ref = lambda x, b, down, up: lora_conv2d_reference(  # noqa: E731
        x, weight.float(), b, down, up, 1.5, stride, padding, 1, groups
    )
    assert_close_to_fp32_oracle(y, got, ref, (x, b, down, up), g, tol)


@needs_cpp
def test_lora_conv2d_fast_path_only_for_the_plain_call(monkeypatch):
    """An unbatched input, torch.compile tracing and a torch request keep the Python path; under
    autocast the general path casts, then runs the op itself with autocast off: the fast path."""
    x, weight, b, down, up = _setup(STRIDED, 2, True, torch.float32)
    geo = dict(stride=2, padding=1)
    assert grad_fn_names(lora_conv2d(x, weight, b, down, up, backend="cpp", **geo))[0] == FAST
    python = "LoRAConv2dFunctionBackward"
    assert python in grad_fn_names(lora_conv2d(x[0], weight, b, down, up, backend="cpp", **geo))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        names = grad_fn_names(lora_conv2d(x, weight, b, down, up, backend="cpp", **geo))
    assert names[0] == FAST and "ToCopyBackward0" in names  # the casts, then the op
    monkeypatch.setenv("LORAFUSE_KERNELS", "torch")
    assert python in grad_fn_names(lora_conv2d(x, weight, b, down, up, **geo))
    from lorafuse.ops import custom_ops

    monkeypatch.setattr(custom_ops, "active", lambda: True)  # as while torch.compile traces
    assert python in grad_fn_names(lora_conv2d(x, weight, b, down, up, backend="cpp", **geo))


@needs_cpp
def test_lora_conv2d_fast_path_checkpoint_hooks_retain_graph_and_double_backward():
    """Non-reentrant checkpointing and user saved-tensor hooks see the Function's saved tensors
    (gradients bit for bit those of a plain run); retain_graph works; no_grad builds no graph;
    a double backward raises."""
    from torch.utils.checkpoint import checkpoint

    x, weight, b, down, up = _setup(POINTWISE, 3, True, torch.float32)
    g = torch.randn(2, 10, 5, 7)

    def block(h):
        return lora_conv2d(torch.tanh(h), weight, b, down, up, 0.5, backend="cpp")

    want = torch.autograd.grad(block(x), [x, b, down, up], g)
    got = torch.autograd.grad(checkpoint(block, x, use_reentrant=False), [x, b, down, up], g)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: packed.append(t) or t.clone(), lambda t: t
    ):
        y = lora_conv2d(x, weight, b, down, up, 0.5, backend="cpp")
    # x, W, down, up and t (2, 3, 5, 7): nothing else, nothing twice
    shapes = sorted(tuple(t.shape) for t in packed)
    assert shapes == [(2, 3, 5, 7), (2, 8, 5, 7), (3, 8, 1, 1), (10, 3, 1, 1), (10, 8, 1, 1)]
    y.backward(g, retain_graph=True)
    first = [t.grad.clone() for t in (x, b, down, up)]
    y.backward(g)  # from the hooks' clones, a second time
    for t, f in zip((x, b, down, up), first):
        assert torch.equal(t.grad, 2 * f)
    with torch.no_grad():
        y0 = lora_conv2d(x, weight, b, down, up, 0.5, backend="cpp")
    assert y0.grad_fn is None and torch.equal(y0, y.detach())
    y = lora_conv2d(x, weight, b, down, up, 0.5, backend="cpp")
    (gx,) = torch.autograd.grad(y.sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


@pytest.mark.parametrize("geometry", [POINTWISE, STRIDED], ids=["1x1", "3x3s2"])
@needs_cpp
def test_lora_conv2d_fast_path_partial_gradients(geometry):
    """Each gradient asked for alone (the others not computed) equals the full backward's."""
    x, weight, b, down, up = _setup(geometry, 3, True, torch.float32)
    _, _, _, stride, padding, groups, _ = geometry

    def run():
        return lora_conv2d(x, weight, b, down, up, 1.5, stride, padding, 1, groups, backend="cpp")

    y = run()
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    full = torch.autograd.grad(y, [x, b, down, up], g)
    for leaf, want in zip([x, b, down, up], full):
        (got,) = torch.autograd.grad(run(), [leaf], g)
        assert torch.equal(got, want)
