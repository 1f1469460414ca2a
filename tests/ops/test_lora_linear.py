"""lora_linear (the template op) against the autograd reference and stock PEFT, every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops.lora_linear import LoRALinearFunction, lora_linear, lora_linear_reference
from lorafuse.testing import (
    FakeQuant,
    assert_close,
    assert_close_to_fp32_oracle,
    grad_fn_names,
    needs_cpp,
    op_cases,
)

CASES = op_cases("lora_linear")
# (leading shape, d in, k out)
SHAPES = [((1, 1), 1023, 65), ((3, 37), 129, 97)]


def _setup(lead, d, k, r, bias, dtype, adapter_dtype=None, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    ad = adapter_dtype or dtype
    x = torch.randn(*lead, d, generator=gen).to(device, dtype).requires_grad_(True)
    w = (torch.randn(k, d, generator=gen) / d**0.5).to(device, dtype)
    b = (
        (0.1 * torch.randn(k, generator=gen)).to(device, dtype).requires_grad_(True)
        if bias
        else None
    )
    A = (torch.randn(r, d, generator=gen) / d**0.5).to(device, ad).requires_grad_(True)
    B = (torch.randn(k, r, generator=gen) / r**0.5).to(device, ad).requires_grad_(True)
    g = torch.randn(*lead, k, generator=gen).to(device, dtype)
    return x, w, b, A, B, g


def _noise(x, A, p, seed):
    """The dropout multiplier lora_linear draws after ``manual_seed(seed)``."""
    if p == 0.0:
        return None
    torch.manual_seed(seed)
    return torch.empty(x.shape, dtype=A.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)


def _leaves(x, b, A, B):
    return [t for t in (x, b, A, B) if t is not None]


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("r", [1, 8, 16, 64])
# bias and dropout paired (each seen on and off per rank and shape) to halve the grid's time
@pytest.mark.parametrize("bias, p", [(False, 0.0), (True, 0.25)])
def test_lora_linear_fp32(backend, device, shape, r, bias, p):
    lead, d, k = shape
    if r == 64 and d > 200:
        d = 96  # rank 64 on a small width only (time budget)
    x, w, b, A, B, g = _setup(lead, d, k, r, bias, torch.float32, device=device)
    torch.manual_seed(9)
    y = lora_linear(x, w, b, A, B, 1.5, p, backend=backend)
    got = torch.autograd.grad(y, _leaves(x, b, A, B), g)
    ry = lora_linear_reference(x, w, b, A, B, 1.5, _noise(x, A, p, 9))
    want = torch.autograd.grad(ry, _leaves(x, b, A, B), g)
    # fp32 vs fp32 autograd, different association only; sums over <= 1023 terms -> 1e-5
    # relative with a floor at 1e-5 of each tensor's scale for entries that cancel near zero.
    assert_close(y, ry, atol=1e-5 * ry.abs().max().item(), rtol=1e-5, name="y")
    for name, a, e in zip(("dx", "db", "dA", "dB") if bias else ("dx", "dA", "dB"), got, want):
        assert_close(a, e, atol=1e-5 * e.abs().max().item(), rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("adapter", ["bf16", "fp32"])
def test_lora_linear_bf16_against_fp32_oracle(backend, device, adapter):
    ad = torch.bfloat16 if adapter == "bf16" else torch.float32
    x, w, b, A, B, g = _setup((2, 9), 64, 48, 8, True, torch.bfloat16, ad, device=device)
    torch.manual_seed(4)
    y = lora_linear(x, w, b, A, B, 2.0, 0.1, backend=backend)
    got = torch.autograd.grad(y, [x, b, A, B], g)
    assert y.dtype == torch.bfloat16 and [t.dtype for t in got] == [x.dtype, b.dtype, ad, ad]
    f = [t.detach().float().requires_grad_(True) for t in (x, b, A, B)]
    noise = _noise(x, A, 0.1, 4).float()
    ry = lora_linear_reference(f[0], w.float(), f[1], f[2], f[3], 2.0, noise)
    want = torch.autograd.grad(ry, f, g.float())
    # bf16 base GEMM (fp32 accumulation, output rounded: 2^-9 relative) plus a rank-8 branch
    # rounded at xa and at the output; gradients see <= 3 such roundings. 2e-2 of each
    # tensor's scale bounds that (fp32 adapters are tighter; one bound keeps the test simple).
    assert_close(y, ry, atol=2e-2 * ry.abs().max().item(), rtol=2e-2, name="y")
    for name, a, e in zip(("dx", "db", "dA", "dB"), got, want):
        assert_close(a, e, atol=2e-2 * e.abs().max().item(), rtol=2e-2, name=name)


def test_lora_linear_dropout_matches_peft_and_nn_dropout_seeded():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(24, 20))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3,
                                            target_modules=["proj"]))  # fmt: skip
    model.train()
    lin = model.base_model.model.proj
    torch.nn.init.normal_(lin.lora_B["default"].weight, std=0.1)
    A, B = lin.lora_A["default"].weight, lin.lora_B["default"].weight
    x = torch.randn(5, 24, requires_grad=True)
    g = torch.randn(5, 20)
    torch.manual_seed(21)
    ry = lin(x)
    want = torch.autograd.grad(ry, [x, A, B], g)
    torch.manual_seed(21)
    y = lora_linear(
        x, lin.base_layer.weight, lin.base_layer.bias, A, B, lin.scaling["default"], 0.3
    )
    got = torch.autograd.grad(y, [x, A, B], g)
    assert_close(y, ry, atol=1e-6, rtol=1e-5, name="y")
    for a, e in zip(got, want):
        assert_close(a, e, atol=1e-6, rtol=1e-5, name="grad")


@pytest.mark.parametrize("backend, device", CASES)
def test_lora_linear_dropout_mask_equals_nn_dropout(backend, device):
    """With W = 0 and A = B = I the op returns dropout(x) itself: it must be nn.Dropout's."""
    if device != "cpu":
        pytest.skip("CUDA nn.Dropout uses a fused Philox kernel; mask-for-mask parity is CPU only")
    d = 24
    x = torch.randn(7, d)
    eye = torch.eye(d)
    torch.manual_seed(33)
    want = torch.nn.Dropout(0.4).train()(x)
    torch.manual_seed(33)
    got = lora_linear(x, torch.zeros(d, d), None, eye, eye, 1.0, 0.4, backend=backend)
    assert torch.equal(got == 0, want == 0)  # the same elements dropped
    assert_close(got, want, atol=1e-6, rtol=1e-6, name="dropout(x)")  # and the same 1/keep


def test_lora_linear_eval_mode_draws_nothing():
    x, w, b, A, B, _ = _setup((3,), 16, 8, 2, False, torch.float32)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    y = lora_linear(x, w, b, A, B, 1.0, 0.5, training=False)
    assert torch.equal(state, torch.get_rng_state())
    assert_close(y, lora_linear_reference(x, w, b, A, B, 1.0), atol=1e-6, rtol=1e-5, name="y")


def test_lora_linear_saves_bf16_input_once_never_an_fp32_copy():
    """fp32 adapters on a bf16 base: x is saved once as bf16; no (N, d) fp32 tensor is saved."""
    x, w, b, A, B, g = _setup((4, 6), 40, 32, 4, False, torch.bfloat16, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lora_linear(x, w, b, A, B, 1.0, 0.2, backend="torch")
    big = [t for t in saved if tuple(t.shape) == (24, 40)]
    assert sum(t.data_ptr() == x.data_ptr() for t in big) == 1, "x must be saved exactly once"
    assert not [t for t in big if t.dtype == torch.float32], "an fp32 copy of x was saved"
    assert {t.dtype for t in big} <= {torch.bfloat16, torch.bool}  # x and the bool mask
    y.backward(g)


def test_lora_linear_quantized_weight_dequantized_in_forward_and_backward():
    x, w, b, A, B, g = _setup((2, 3), 32, 24, 4, True, torch.float32)
    fake = FakeQuant(w)
    y = lora_linear(x, fake, b, A, B, 2.0, backend="torch")
    assert fake.calls == 1
    got = torch.autograd.grad(y, [x, b, A, B], g)
    assert fake.calls == 2  # dequantized again in backward, never saved
    ry = lora_linear_reference(x, w, b, A, B, 2.0)
    want = torch.autograd.grad(ry, [x, b, A, B], g)
    assert_close(y, ry, atol=1e-6, rtol=1e-5, name="y")
    for a, e in zip(got, want):
        assert_close(a, e, atol=1e-6, rtol=1e-5, name="grad")


def test_lora_linear_frozen_bias_and_base_get_no_grad():
    x, w, _, A, B, g = _setup((3,), 16, 8, 2, False, torch.float32)
    b = torch.zeros(8)
    y = lora_linear(x, w, b, A, B)
    y.backward(g)
    assert b.grad is None and w.grad is None and A.grad is not None


def test_lora_linear_refuses_trainable_base_weight():
    x, w, b, A, B, _ = _setup((3,), 16, 8, 2, False, torch.float32)
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(x, w.clone().requires_grad_(True), b, A, B)
    with torch.no_grad():  # inference with a trainable weight is fine: no gradient is dropped
        lora_linear(x, w.clone().requires_grad_(True), b, A, B)


def test_lora_linear_errors_name_the_problem():
    x, w, b, A, B, _ = _setup((2,), 16, 8, 4, False, torch.float32)
    with pytest.raises(ValueError, match=r"weight must be \(out, 16\)"):
        lora_linear(x, w[:, :15], b, A, B)
    with pytest.raises(ValueError, match=r"lora_B must be \(8, 4\)"):
        lora_linear(x, w, b, A, B[:, :3])
    with pytest.raises(ValueError, match="input dtype torch.float64"):
        lora_linear(x.double(), w, b, A, B)
    with pytest.raises(ValueError, match="dropout_p"):
        lora_linear(x, w, b, A, B, dropout_p=1.0)


# ---- the C++ autograd fast path (csrc/lora_autograd.cpp) ---------------------------------------


FAST = "torch::autograd::CppNode<lorafuse::LoRALinearFunction>"


def _python_function(x, w, b, A, B, s):
    """The same call through the Python autograd.Function (what the fast path replaces)."""
    y = LoRALinearFunction.apply(x.reshape(-1, x.shape[-1]), w, b, A, B, s, 0.0, "cpp")
    return y.reshape(*x.shape[:-1], w.shape[0])


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
@pytest.mark.parametrize("bias, x_grad", [(True, True), (False, True), (True, False)])
@needs_cpp
def test_lora_linear_fast_path_equals_python_function_bit_for_bit(
    dtype, adapter, cpu_low_precision, bias, x_grad
):
    """Same kernels, so the same bits as the Python Function: output and every gradient (x not
    requiring grad: attn2's k/v on text states); and the reference within the op's tolerances."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    x, w, b, A, B, g = _setup((2, 5), 33, 20, 4, bias, dt[dtype], dt[adapter])
    x.requires_grad_(x_grad)
    leaves = [t for t in _leaves(x, b, A, B) if t.requires_grad]
    y = lora_linear(x, w, b, A, B, 1.5, backend="cpp")
    assert grad_fn_names(y)[0] == FAST
    got = torch.autograd.grad(y, leaves, g)
    py = _python_function(x, w, b, A, B, 1.5)
    assert "LoRALinearFunctionBackward" in grad_fn_names(py)
    want = torch.autograd.grad(py, leaves, g)
    assert y.dtype == py.dtype and torch.equal(y, py)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e)
    # fp32: different association only (1e-5, as test_lora_linear_fp32); bf16: as
    # test_lora_linear_bf16_against_fp32_oracle (<= 3 roundings of 2^-9 -> 2e-2 of the scale).
    tol = 1e-5 if dtype == "fp32" else 2e-2
    ref = lambda x, b, A, B: lora_linear_reference(x, w.float(), b, A, B, 1.5)  # noqa: E731
    assert_close_to_fp32_oracle(y, got, ref, (x, b, A, B), g, tol)


@needs_cpp
def test_lora_linear_fast_path_only_for_the_plain_call(monkeypatch):
    """Dropout (training), a quantized weight, torch.compile tracing and a torch request keep the
    Python path; dropout in eval mode draws nothing, so it takes the fast one. Under autocast the
    general path casts the operands, then runs the op itself with autocast off: the fast path."""
    x, w, b, A, B, _ = _setup((3, 4), 16, 8, 2, True, torch.float32)
    assert grad_fn_names(lora_linear(x, w, b, A, B, backend="cpp"))[0] == FAST
    assert grad_fn_names(lora_linear(x, w, b, A, B, 1.0, 0.3, False, "cpp"))[0] == FAST
    python = "LoRALinearFunctionBackward"
    assert python in grad_fn_names(lora_linear(x, w, b, A, B, 1.0, 0.3, True, "cpp"))
    assert python in grad_fn_names(lora_linear(x, FakeQuant(w), b, A, B, backend="cpp"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        names = grad_fn_names(lora_linear(x, w, b, A, B, backend="cpp"))
    assert names[0] == FAST and "ToCopyBackward0" in names  # the casts, then the op
    monkeypatch.setenv("LORAFUSE_KERNELS", "torch")
    assert python in grad_fn_names(lora_linear(x, w, b, A, B))
    monkeypatch.setenv("LORAFUSE_KERNELS", "cpp")
    assert grad_fn_names(lora_linear(x, w, b, A, B))[0] == FAST
    from lorafuse.ops import custom_ops

    monkeypatch.setattr(custom_ops, "active", lambda: True)  # as while torch.compile traces
    assert FAST not in grad_fn_names(lora_linear(x, w, b, A, B, backend="cpp"))


@needs_cpp
def test_lora_linear_fast_path_checkpoint_and_saved_tensor_hooks():
    """Non-reentrant checkpointing (saved-tensor hooks that drop and recompute) and user hooks
    see the Function's saved tensors; the gradients are those of a plain run, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    x, w, b, A, B, g = _setup((2, 6), 24, 24, 4, True, torch.float32)

    def block(h):
        return lora_linear(torch.tanh(lora_linear(h, w, b, A, B, 0.5)), w, b, A, B, 0.5)

    want = torch.autograd.grad(block(x), [x, b, A, B], g)
    y = checkpoint(block, x, use_reentrant=False)
    assert torch.equal(y, block(x))
    got = torch.autograd.grad(y, [x, b, A, B], g)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: packed.append(t) or t.clone(), lambda t: t
    ):
        y = lora_linear(x, w, b, A, B, 0.5)
    assert grad_fn_names(y)[0] == FAST
    # x (flattened: a view of x), W, A, B and xa (12, 4): nothing else, nothing twice
    assert sorted(tuple(t.shape) for t in packed) == [(4, 24), (12, 4), (12, 24), (24, 4), (24, 24)]
    got = torch.autograd.grad(y, [x, b, A, B], g)  # from the hooks' clones
    want = torch.autograd.grad(lora_linear(x, w, b, A, B, 0.5), [x, b, A, B], g)
    for a, e in zip(got, want):
        assert torch.equal(a, e)


@needs_cpp
def test_lora_linear_fast_path_retain_graph_no_grad_and_double_backward():
    x, w, b, A, B, g = _setup((5,), 12, 10, 3, False, torch.float32)
    y = lora_linear(x, w, b, A, B, backend="cpp")
    y.backward(g, retain_graph=True)
    first = [t.grad.clone() for t in (x, A, B)]
    y.backward(g)  # the saved tensors survived the first backward
    for t, f in zip((x, A, B), first):
        assert torch.equal(t.grad, 2 * f)
    with torch.no_grad():
        y0 = lora_linear(x, w, b, A, B, backend="cpp")
    assert y0.grad_fn is None and not y0.requires_grad and torch.equal(y0, y.detach())
    (gx,) = torch.autograd.grad(lora_linear(x, w, b, A, B).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


@needs_cpp
def test_lora_linear_fast_path_partial_gradients():
    """Each gradient asked for alone (the others not computed) equals the full backward's."""
    x, w, b, A, B, g = _setup((3, 5), 20, 12, 4, True, torch.float32)
    full = torch.autograd.grad(lora_linear(x, w, b, A, B, 1.5), [x, b, A, B], g)
    for leaf, want in zip([x, b, A, B], full):
        (got,) = torch.autograd.grad(lora_linear(x, w, b, A, B, 1.5), [leaf], g)
        assert torch.equal(got, want)
