"""lora_qkv against the autograd reference and three stock PEFT LoRA Linears, every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops import lora_qkv as lora_qkv_module
from lorafuse.ops.lora_projection import flatten, meta_of, stackable
from lorafuse.ops.lora_qkv import LoRAParams, LoRAQKVFunction, lora_qkv, lora_qkv_reference
from lorafuse.testing import FakeQuant, assert_close, count_calls, op_cases

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


class _Attn(torch.nn.Module):
    """Three plain linears called in LlamaAttention's order (q, k, v), for stock PEFT."""

    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 32, bias=False)
        self.k_proj = torch.nn.Linear(32, 16, bias=False)
        self.v_proj = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def test_lora_qkv_matches_three_peft_linears_with_seeded_dropout():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2,
                     target_modules=["q_proj", "k_proj", "v_proj"])  # fmt: skip
    model = get_peft_model(_Attn(), cfg)
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


# ---- the stacked path: one x·[A_q; A_k; A_v]ᵀ for the projections' adapters (lora_params) ----
STACKING = [c for c in CASES if c.values[0] in ("torch", "cpp")]  # Triton keeps one per projection


def _count_stacked(monkeypatch) -> list:
    return count_calls(monkeypatch, lora_qkv_module, "split_forward")


def _ranked(ranks, dtype, adapter_dtype, lead=(3, 11), d=40, outs=(32, 16, 16), seed=1):
    """x, (q, k, v), grads; GQA widths; ``ranks[i]`` None: no adapter on that projection."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=gen).to(dtype).requires_grad_(True)
    params = []
    for out, r in zip(outs, ranks):
        p = _proj(gen, d, out, r, True, dtype, 0.0)
        if r is not None:  # adapters in their own dtype, as PEFT keeps fp32 ones on a bf16 base
            p = p._replace(**{n: getattr(p, n).detach().to(adapter_dtype).requires_grad_(True)
                              for n in ("lora_A", "lora_B")})  # fmt: skip
        params.append(p)
    gs = [torch.randn(*lead, out, generator=gen).to(dtype) for out in outs]
    return x, params, gs


@pytest.mark.parametrize("backend, device", STACKING)
# all three; k without adapter; a different rank per projection (PEFT's rank_pattern)
@pytest.mark.parametrize("ranks", [(8, 8, 8), (8, None, 4), (2, 16, 5)])
def test_lora_qkv_stacks_shared_input_and_equals_per_projection(
    backend, device, ranks, monkeypatch
):
    calls = _count_stacked(monkeypatch)
    x, params, gs = _ranked(ranks, torch.float32, torch.float32)
    outs = lora_qkv(x, *params, backend=backend)
    assert calls == [1]  # the stacked path was taken
    got = torch.autograd.grad(outs, _leaves(x, params), gs)
    x2 = x.reshape(-1, x.shape[-1])  # (N, d)
    per = LoRAQKVFunction.apply(x2, *flatten(params), meta_of(params), backend, False)
    want = torch.autograd.grad(
        per, _leaves(x, params), [g.reshape(o.shape) for g, o in zip(gs, per)]
    )
    assert calls == [1]  # stacked=False ran the per-projection kernels
    # fp32 both ways: same products, summed in another order (dx: one stacked rank-R product
    # instead of three rank-r ones) -> 1e-5 of each tensor's scale.
    for a, b in zip(outs, per):
        assert_close(a.reshape(b.shape), b, atol=1e-5 * b.abs().max().item(), rtol=1e-5, name="out")
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-5, name=f"grad[{i}]")


@pytest.mark.parametrize("backend, device", STACKING)
def test_lora_qkv_stacked_bf16_base_fp32_adapters_against_fp32_oracle(backend, device, monkeypatch):
    """PEFT's default on a bf16 model (fp32 adapters): x is cast to fp32 once for all three."""
    calls = _count_stacked(monkeypatch)
    x, params, gs = _ranked((8, 4, 8), torch.bfloat16, torch.float32)
    outs = lora_qkv(x, *params, backend=backend)
    got = torch.autograd.grad(outs, _leaves(x, params), gs)
    assert calls == [1]

    def up(t):
        return None if t is None else t.detach().float().requires_grad_(t.requires_grad)

    xf = up(x)
    pf = [p._replace(weight=up(p.weight), bias=up(p.bias), lora_A=up(p.lora_A),
                     lora_B=up(p.lora_B)) for p in params]  # fmt: skip
    refs = lora_qkv_reference(xf, *pf)
    want = torch.autograd.grad(refs, _leaves(xf, pf), [g.float() for g in gs])
    # bf16 base GEMMs round each (N, out) / (N, d) result to bf16 (2^-9 relative); the fp32
    # adapter products stay exact, their sum with the base rounds once more: 2e-2 of scale, as
    # the bf16 oracle test above.
    for a, b in zip(outs, refs):
        assert_close(a.float(), b, atol=2e-2 * b.abs().max().item(), rtol=2e-2, name="out")
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a.float(), b, atol=2e-2 * b.abs().max().item(), rtol=2e-2, name=f"grad[{i}]")


def test_lora_qkv_stacks_only_a_shared_input():
    _, params, _ = _ranked((4, 4, 4), torch.float32, torch.float32)
    q, k, v = params
    assert stackable(params, "cpp") and stackable(params, "torch")
    assert not stackable(params, "triton")  # one kernel per projection there (not measured)
    assert not stackable([q, k._replace(dropout_p=0.1), v], "cpp")  # own mask: no shared input
    mixed = v._replace(lora_A=v.lora_A.double(), lora_B=v.lora_B.double())
    assert not stackable([q, k, mixed], "cpp")  # adapter dtypes differ
    bare = k._replace(lora_A=None, lora_B=None)
    assert not stackable([q, bare, bare], "cpp")  # one adapter: nothing to stack
    x = torch.randn(5, 40)
    with pytest.raises(ValueError, match="stacked=True"):
        LoRAQKVFunction.apply(x, *flatten([q, bare, bare]), meta_of([q, bare, bare]), "cpp", True)


def test_lora_qkv_with_dropout_keeps_per_projection_kernels(monkeypatch):
    calls = _count_stacked(monkeypatch)
    x, params, gs = _ranked((4, 4, 4), torch.float32, torch.float32)
    params = [p._replace(dropout_p=0.2) for p in params]
    torch.autograd.grad(lora_qkv(x, *params, backend="torch"), _leaves(x, params), gs)
    assert calls == []


def test_lora_qkv_stacked_matches_peft_rank_pattern():
    """Three stock PEFT LoRA Linears with a rank per projection, no dropout: the stacked path."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, rank_pattern={"k_proj": 2, "v_proj": 6},
                     target_modules=["q_proj", "k_proj", "v_proj"])  # fmt: skip
    model = get_peft_model(_Attn(), cfg)
    for n, prm in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(prm, std=0.1)
    attn = model.base_model.model
    params = [LoRAParams(m.base_layer.weight, None, m.lora_A["default"].weight,
                         m.lora_B["default"].weight, m.scaling["default"], 0.0)
              for m in (attn.q_proj, attn.k_proj, attn.v_proj)]  # fmt: skip
    assert [p.lora_A.shape[0] for p in params] == [4, 2, 6] and stackable(params, "torch")
    x = torch.randn(3, 6, 32, requires_grad=True)
    gs = [torch.randn(3, 6, n) for n in (32, 16, 16)]
    loras = [p for n, p in model.named_parameters() if "lora_" in n]
    refs = attn(x)
    want = torch.autograd.grad(refs, [x, *loras], gs)
    outs = lora_qkv(x, *params)
    got = torch.autograd.grad(outs, [x, *loras], gs)
    for a, b in zip(outs, refs):
        assert_close(a, b, atol=1e-6, rtol=1e-5, name="out")
    for a, b in zip(got, want):
        assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-5, name="grad")


@pytest.mark.parametrize("backend, device", STACKING)
def test_lora_qkv_stacked_bf16_dA_is_rounded_once(backend, device):
    """dA = (s·g·B)ᵀ·x sums N terms that cancel; the stacked path keeps gB in fp32, as the C++
    kernel does, so each dA element is its fp32 value rounded once to bf16 (2^-8 relative).
    Rounding gB to bf16 first puts 10-35x that error into dA at this shape (N, d, r) =
    (111, 129, 1); the floor of 1e-5 of dA's scale only absorbs fp32 summation order."""
    x, params, gs = _ranked((1, 1, 1), torch.bfloat16, torch.bfloat16, lead=(111,), d=129)
    outs = lora_qkv(x, *params, backend=backend)
    As = [p.lora_A for p in params]
    got = torch.autograd.grad(outs, As, gs)
    for p, g, dA in zip(params, gs, got):
        gB = (g.float() @ p.lora_B.detach().float()) * p.scaling  # (N, 1) in fp32
        want = gB.t() @ x.detach().float()  # (1, d)
        tol = 2**-8 * want.abs() + 1e-5 * want.abs().max()
        assert ((dA.float() - want).abs() <= tol).all(), ((dA.float() - want).abs() / tol).max()


@pytest.mark.parametrize("dropout", [0.0, 0.1])  # stacked A products / one kernel per projection
def test_quantized_qkv_keeps_at_most_one_dense_weight_alive(dropout):
    """QLoRA's memory promise: forward and backward dequantize one projection at a time."""
    import gc

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen, requires_grad=True)
    params = []
    for out in (16, 8, 8):
        A = torch.randn(4, 16, generator=gen).requires_grad_(True)
        B = torch.randn(out, 4, generator=gen).requires_grad_(True)
        params.append(LoRAParams(FakeQuant(torch.randn(out, 16, generator=gen)), None, A, B,
                                 2.0, dropout))  # fmt: skip
    gc.collect()
    FakeQuant.reset_alive()
    q, k, v = lora_qkv(x, *params, backend="torch")
    (q.sum() + k.sum() + v.sum()).backward()
    gc.collect()
    assert FakeQuant.peak_alive == 1 and FakeQuant.alive == 0
