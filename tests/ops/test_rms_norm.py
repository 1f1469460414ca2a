"""rms_norm against the HF-exact torch reference and transformers' LlamaRMSNorm, every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse import backends
from lorafuse.ops.rms_norm import rms_norm, rms_norm_reference
from lorafuse.testing import assert_close, op_cases

CASES = op_cases("rms_norm")
SHAPES = [(1, 1, 1023), (3, 37, 129), (5, 64)]


def _inputs(shape, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3.0).to(device, dtype)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    g = torch.randn(shape, generator=gen).to(device, dtype)
    return x, w, g


def _run(fn, x, w, g):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(g)
    return y, x.grad, w.grad


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_fp32(backend, device, shape):
    x, w, g = _inputs(shape, torch.float32, device=device)
    y, dx, dw = _run(lambda a, b: rms_norm(a, b, 1e-6, backend=backend), x, w, g)
    ry, rdx, rdw = _run(lambda a, b: rms_norm_reference(a, b, 1e-6), x, w, g)
    # fp32 against fp32 autograd: only summation order differs (rows of up to 1023 terms).
    assert_close(y, ry, atol=1e-5, rtol=1e-5, name="y")
    assert_close(dx, rdx, atol=1e-5, rtol=1e-5, name="dx")
    # dw sums over up to 111 rows of O(1) products: allow that many ulps of absolute slack.
    assert_close(dw, rdw, atol=1e-4, rtol=1e-5, name="dw")


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_rms_norm_bf16_against_fp32_oracle(backend, device, shape):
    x, w, g = _inputs(shape, torch.bfloat16, device=device)
    y, dx, dw = _run(lambda a, b: rms_norm(a, b, 1e-6, backend=backend), x, w, g)
    ry, rdx, rdw = _run(
        lambda a, b: rms_norm_reference(a, b, 1e-6), x.float(), w.float(), g.float()
    )
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    # The op rounds n = x·rstd to bf16 before the weight multiply (as HF does) and rounds y once
    # more: two bf16 roundings of 2^-9 relative each -> 1e-2 relative covers them with margin.
    assert_close(y, ry, atol=1e-3, rtol=1e-2, name="y")
    # dx = rstd·(g·w - n·mean(g·w·n)): fp32 math, one final rounding, plus the bf16-rounded n in
    # dw; the subtraction can cancel, so the absolute floor is scaled to the gradient's size.
    assert_close(dx, rdx, atol=1e-2 * rdx.abs().max().item(), rtol=1e-2, name="dx")
    assert_close(dw, rdw, atol=1e-2 * rdw.abs().max().item(), rtol=1e-2, name="dw")


@pytest.mark.parametrize("backend, device", CASES)
def test_rms_norm_matches_transformers_module(backend, device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w, g = _inputs((2, 7, 48), torch.float32, seed=3, device=device)
    module = LlamaRMSNorm(48, eps=1e-5).to(device)
    with torch.no_grad():
        module.weight.copy_(w)
    xr = x.clone().requires_grad_(True)
    ry = module(xr)
    ry.backward(g)
    y, dx, dw = _run(lambda a, b: rms_norm(a, b, 1e-5, backend=backend), x, w, g)
    assert_close(y, ry, atol=1e-6, rtol=1e-6, name="y")
    assert_close(dx, xr.grad, atol=1e-5, rtol=1e-5, name="dx")
    assert_close(dw, module.weight.grad, atol=1e-4, rtol=1e-5, name="dw")


def test_rms_norm_bf16_torch_path_is_bit_exact_with_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w, _ = _inputs((3, 5, 40), torch.bfloat16, seed=4)
    module = LlamaRMSNorm(40).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
        assert torch.equal(rms_norm(x, w, 1e-6, backend="torch"), module(x))


def test_rms_norm_frozen_weight_gets_no_grad_and_trainable_weight_does():
    x, w, g = _inputs((4, 16), torch.float32)
    x.requires_grad_(True)
    rms_norm(x, w, backend="torch").backward(g)
    assert w.grad is None and x.grad is not None
    w2 = w.clone().requires_grad_(True)
    rms_norm(x.detach(), w2, backend="torch").backward(g)
    assert w2.grad is not None and w2.grad.abs().sum() > 0


def test_rms_norm_mixed_dtype_promotes_like_hf():
    x, w, g = _inputs((3, 32), torch.bfloat16)
    w32 = w.float()
    y = rms_norm(x, w32, backend="torch")
    assert y.dtype == torch.float32
    assert torch.equal(y, rms_norm_reference(x, w32, 1e-6))


@pytest.mark.cpp
def test_rms_norm_mixed_dtype_choice_goes_through_select(monkeypatch):
    """cpp asked for, mixed dtypes given: torch runs, one warning, the reason in choices()."""
    if not backends.cpp_available():
        pytest.skip("C++ extension not built here")
    monkeypatch.setattr(backends, "_warned", set())  # warned once per process: start afresh
    x, w, _ = _inputs((3, 32), torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="differs from input dtype"):
        y = rms_norm(x, w.float(), backend="cpp")
    assert torch.equal(y, rms_norm_reference(x, w.float(), 1e-6))
    assert backends.choices()["rms_norm (cpu)"].startswith("torch: weight dtype torch.float32")
    rms_norm(x, w, backend="cpp")  # equal dtypes: the C++ kernel again
    assert backends.choices()["rms_norm (cpu)"] == "cpp: requested"


def test_rms_norm_errors_name_the_problem():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight must be \(8,\)"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="floating-point"):
        rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(8), eps=-1.0)


@pytest.mark.cpp
def test_cpp_kernel_names_a_dtype_mismatch():
    """The C++ forward reads the weight as stored, so it takes equal dtypes only (the op sends
    mixed dtypes to torch, above); called directly with mixed ones it says so."""
    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")
    forward, _ = backends.compiled("rms_norm", "cpp", "forward", "backward")
    with pytest.raises(RuntimeError, match="weight dtype Float differs from x dtype BFloat16"):
        forward(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)


# ---- round_once: the weight multiply in fp32, one rounding (Gemma, Qwen3.5, OLMo 3) ----------


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_once_fp32_matches_reference(backend, device, shape):
    x, w, g = _inputs(shape, torch.float32, seed=5, device=device)
    y, dx, dw = _run(lambda a, b: rms_norm(a, b, 1e-6, backend, round_once=True), x, w, g)
    ry, rdx, rdw = _run(lambda a, b: rms_norm_reference(a, b, 1e-6, round_once=True), x, w, g)
    assert_close(y, ry, atol=1e-5, rtol=1e-5, name="y")
    assert_close(dx, rdx, atol=1e-5, rtol=1e-5, name="dx")
    assert_close(dw, rdw, atol=1e-4, rtol=1e-5, name="dw")


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("cls", ["Olmo3RMSNorm", "Gemma4RMSNorm", "Qwen3_5RMSNorm"])
def test_round_once_bf16_input_fp32_weight_is_the_models_norm(backend, device, cls):
    """bf16 x with the model's fp32 weight (Gemma / Qwen3.5: 1 + w formed in fp32): y equal to
    the transformers module's to one bf16 ulp (its rsqrt / pow(-0.5) may differ in the last fp32
    bit), dx and dw against the module's autograd in fp32 arithmetic."""
    import transformers.models.gemma4.modeling_gemma4 as g4
    import transformers.models.olmo3.modeling_olmo3 as o3
    import transformers.models.qwen3_5.modeling_qwen3_5 as q35

    module = {"Olmo3RMSNorm": o3, "Gemma4RMSNorm": g4, "Qwen3_5RMSNorm": q35}[cls]
    norm = getattr(module, cls)(40, eps=1e-6).to(device)
    x, w, g = _inputs((3, 5, 40), torch.bfloat16, seed=6, device=device)
    with torch.no_grad():
        norm.weight.copy_(w.float() - (1.0 if cls == "Qwen3_5RMSNorm" else 0.0))
    xr = x.clone().requires_grad_(True)
    ry = norm(xr)
    ry.backward(g)
    weight = (1.0 + norm.weight if cls == "Qwen3_5RMSNorm" else norm.weight).detach()
    y, dx, dw = _run(lambda a, b: rms_norm(a, b, 1e-6, backend, round_once=True), x, weight, g)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert_close(y.float(), ry.float(), atol=0, rtol=2**-8, name="y")  # one bf16 ulp
    _, rdx, rdw = _run(
        lambda a, b: rms_norm_reference(a, b, 1e-6, round_once=True), x.float(), w.float(),
        g.float(),
    )  # fmt: skip
    # dx: fp32 math and one rounding; dw: fp32 sums of g·n (n unrounded) over 15 rows
    assert_close(dx.float(), rdx, atol=1e-2 * rdx.abs().max().item(), rtol=1e-2, name="dx")
    assert_close(dw, rdw, atol=1e-3 * rdw.abs().max().item(), rtol=1e-3, name="dw")
    assert_close(dw, norm.weight.grad, atol=1e-3 * rdw.abs().max().item(), rtol=1e-3, name="dw")


@pytest.mark.parametrize("backend, device", CASES)
def test_round_once_bf16_is_closer_to_fp32_than_llama_rounding(backend, device):
    """The reason for the mode: rounded once, y is nearer the fp32 result than w * round(n)."""
    x, w, _ = _inputs((64, 256), torch.bfloat16, seed=7, device=device)
    oracle = rms_norm_reference(x.float(), w.float(), 1e-6)
    once = rms_norm(x, w.float(), 1e-6, backend, round_once=True).float()
    llama = rms_norm(x, w, 1e-6, backend).float()
    assert (once - oracle).pow(2).mean() < (llama - oracle).pow(2).mean()
