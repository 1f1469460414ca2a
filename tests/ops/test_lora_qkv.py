"""lora_qkv against the autograd reference and three stock PEFT LoRA Linears, every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops.lora_qkv import LoRAParams, lora_qkv, lora_qkv_reference
from lorafuse.testing import FakeQuant, assert_close, op_cases

CASES = op_cases("lora_linear")
# (leading shape, d, q out, k/v out): one wide token; GQA with odd widths.
SHAPES = [((1, 1), 1023, 64, 32), ((3, 37), 129, 96, 48)]


def _proj(gen, d, out, r, bias, dtype, p, device="cpu"):
    w = (torch.randn(out, d, generator=gen) / d**0.5).to(device, dtype)
    b = (
        (0.1 * torch.randn(out, generator=gen)).to(device, dtype).requires_grad_(True)
        if bias
        else None
    )
    if r is None:
        return LoRAParams(w, b)
    A = (torch.randn(r, d, generator=gen) / d**0.5).to(device, dtype).requires_grad_(True)
    B = (torch.randn(out, r, generator=gen) / r**0.5).to(device, dtype).requires_grad_(True)
    return LoRAParams(w, b, A, B, 0.5, p)


def _setup(lead, d, oq, okv, r, bias, p, dtype, seed=0, lora_on=(True, True, True), device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=gen).to(device, dtype).requires_grad_(True)
    params = [
        _proj(gen, d, out, r if on else None, bias, dtype, p, device)
        for out, on in zip((oq, okv, okv), lora_on)
    ]
    gs = [torch.randn(*lead, out, generator=gen).to(device, dtype) for out in (oq, okv, okv)]
    return x, params, gs


def _noises(x, params, seed):
    """The dropout multipliers the op draws after ``manual_seed(seed)``, in q, k, v order."""
    torch.manual_seed(seed)
    out = []
    for p in params:
        if p.lora_A is None or p.dropout_p == 0.0:
            out.append(None)
            continue
        keep = 1.0 - p.dropout_p
        out.append(
            torch.empty(x.shape, dtype=p.lora_A.dtype, device=x.device).bernoulli_(keep).div_(keep)
        )
    return out


def _leaves(x, params):
    return [x] + [t for p in params for t in (p.bias, p.lora_A, p.lora_B) if t is not None]


def _compare(x, params, gs, backend, up_cast=None, *, atol, rtol, seed=3):
    torch.manual_seed(seed)
    outs = lora_qkv(x, *params, backend=backend)
    got = torch.autograd.grad(outs, _leaves(x, params), gs)
    noises = _noises(x, params, seed)
    if up_cast is not None:  # fp32 oracle on the same (bf16-exact) values
        x, params, gs = up_cast(x), [up_cast(p) for p in params], [g.float() for g in gs]
        noises = [n if n is None else n.float() for n in noises]
    refs = lora_qkv_reference(x, *params, noises=noises)
    want = torch.autograd.grad(refs, _leaves(x, params), gs)
    for name, a, b in zip("qkv", outs, refs):
        assert a.dtype == x.dtype or up_cast is not None
        assert_close(a, b, atol=atol(b), rtol=rtol, name=name)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, atol=atol(b), rtol=rtol, name="dx" if i == 0 else f"grad[{i}]")


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("r", [1, 8, 16, 64])
# bias and dropout paired (each seen on and off per rank and shape) to halve the grid's time
@pytest.mark.parametrize("bias, p", [(False, 0.0), (True, 0.25)])
def test_lora_qkv_fp32(backend, device, shape, r, bias, p):
    lead, d, oq, okv = shape
    if r == 64 and d > 200:
        d = 96  # rank 64 on a small width only (time budget)
    x, params, gs = _setup(lead, d, oq, okv, r, bias, p, torch.float32, device=device)
    # fp32 vs fp32 autograd: same products, different association (bracketing through rank r,
    # three dx summed in one place); sums over <= 1023 terms -> 1e-5 relative, with a floor at
    # 1e-5 of each tensor's scale for entries that cancel to near zero.
    _compare(x, params, gs, backend, atol=lambda t: 1e-5 * t.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_lora_qkv_bf16_against_fp32_oracle(backend, device, p):
    x, params, gs = _setup((2, 5), 48, 32, 16, 8, True, p, torch.bfloat16, device=device)

    def up_cast(t):
        if isinstance(t, LoRAParams):
            fields = ("weight", "bias", "lora_A", "lora_B")
            return t._replace(**{f: up_cast(getattr(t, f)) for f in fields})
        if t is None:
            return None
        return t.detach().float().requires_grad_(t.requires_grad)

    # One bf16 GEMM layer with the rank-r intermediate rounded to bf16 (2^-9 relative each):
    # outputs and gradients pass through <= 3 roundings; 2e-2 of each tensor's scale bounds it.
    _compare(x, params, gs, backend, up_cast, atol=lambda t: 2e-2 * t.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("lora_on", [(True, False, True), (False, False, False)])
def test_lora_qkv_partial_lora(lora_on):
    x, params, gs = _setup((2, 7), 32, 32, 16, 4, True, 0.1, torch.float32, lora_on=lora_on)
    _compare(x, params, gs, "torch", atol=lambda t: 1e-5 * t.abs().max().item(), rtol=1e-5)


def test_lora_qkv_saves_input_once_and_dequantizes_twice():
    x, params, gs = _setup((4, 5), 40, 32, 16, 4, False, 0.0, torch.float32)
    fakes = [FakeQuant(p.weight) for p in params]
    qparams = [p._replace(weight=f) for p, f in zip(params, fakes)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs = lora_qkv(x, *qparams, backend="torch")
    assert sum(t.data_ptr() == x.data_ptr() for t in saved) == 1  # x saved once
    assert not any(t.shape in ((32, 40), (16, 40)) for t in saved)  # no dense weight saved
    assert [f.calls for f in fakes] == [1, 1, 1]
    got = torch.autograd.grad(outs, _leaves(x, params), gs)
    assert [f.calls for f in fakes] == [2, 2, 2]
    want = torch.autograd.grad(lora_qkv_reference(x, *params), _leaves(x, params), gs)
    for a, b in zip(got, want):
        assert_close(a, b, atol=1e-6, rtol=1e-5, name="grad")


def test_lora_qkv_matches_three_peft_linears_with_seeded_dropout():
    from peft import LoraConfig, get_peft_model

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(32, 32, bias=False)
            self.k_proj = torch.nn.Linear(32, 16, bias=False)
            self.v_proj = torch.nn.Linear(32, 16, bias=False)

        def forward(self, x):  # LlamaAttention's call order
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2,
                     target_modules=["q_proj", "k_proj", "v_proj"])  # fmt: skip
    model = get_peft_model(Attn(), cfg)
    model.train()
    for n, prm in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(prm, std=0.1)
    attn = model.base_model.model
    x = torch.randn(3, 6, 32, requires_grad=True)
    gs = [torch.randn(3, 6, n) for n in (32, 16, 16)]
    loras = [p for n, p in model.named_parameters() if "lora_" in n]
    torch.manual_seed(5)
    refs = attn(x)
    want = torch.autograd.grad(refs, [x, *loras], gs)

    def params(m):
        return LoRAParams(m.base_layer.weight, None, m.lora_A["default"].weight,
                          m.lora_B["default"].weight, m.scaling["default"], 0.2)  # fmt: skip

    torch.manual_seed(5)
    outs = lora_qkv(x, params(attn.q_proj), params(attn.k_proj), params(attn.v_proj))
    got = torch.autograd.grad(outs, [x, *loras], gs)
    for a, b in zip(outs, refs):
        assert_close(a, b, atol=1e-6, rtol=1e-5, name="out")
    for a, b in zip(got, want):
        assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-5, name="grad")


def test_lora_qkv_eval_draws_no_dropout():
    x, params, _ = _setup((2, 3), 16, 16, 8, 2, False, 0.5, torch.float32)
    torch.manual_seed(0)
    a = lora_qkv(x, *params, training=False)
    b = lora_qkv_reference(x, *params)
    for u, w in zip(a, b):
        assert_close(u, w, atol=1e-6, rtol=1e-5, name="eval out")


def test_lora_qkv_errors_name_the_problem():
    x, (q, k, v), _ = _setup((2,), 16, 16, 8, 4, False, 0.0, torch.float32)
    with pytest.raises(ValueError, match=r"k.weight must be \(out, 16\)"):
        lora_qkv(x, q, k._replace(weight=torch.randn(8, 15)), v)
    with pytest.raises(ValueError, match=r"v.lora_A must be \(r, 16\)"):
        lora_qkv(x, q, k, v._replace(lora_A=torch.randn(4, 15)))
    with pytest.raises(ValueError, match=r"q.bias must be \(16,\)"):
        lora_qkv(x, q._replace(bias=torch.zeros(3)), k, v)
    with pytest.raises(ValueError, match="dropout_p"):
        lora_qkv(x, q._replace(dropout_p=1.0), k, v)
    with pytest.raises(TypeError, match="LoRAParams"):
        lora_qkv(x, (q.weight,), k, v)
