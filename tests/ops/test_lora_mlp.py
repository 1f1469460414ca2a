"""lora_mlp against the autograd reference and a stock PEFT-wrapped LlamaMLP, every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops import lora_mlp as lora_mlp_module
from lorafuse.ops.lora_mlp import (
    LoRAMLPFunction,
    LoRAParams,
    lora_mlp,
    lora_mlp_reference,
    stack_gate_up,
)
from lorafuse.ops.lora_projection import flatten, meta_of
from lorafuse.testing import FakeQuant, assert_close, count_calls, op_cases, tiny_llama_config

CASES = op_cases("lora_linear", "swiglu")
# (leading shape, d, I): odd sizes; the 1023-wide case has one token.
SHAPES = [((1, 1), 1023, 37), ((3, 37), 129, 97)]


def _proj(gen, d_in, d_out, r, bias, dtype, p, adapter_dtype=None, device="cpu"):
    w = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to(device, dtype)
    b = (
        (0.1 * torch.randn(d_out, generator=gen)).to(device, dtype).requires_grad_(True)
        if bias
        else None
    )
    if r is None:
        return LoRAParams(w, b)
    ad = adapter_dtype or dtype
    A = (torch.randn(r, d_in, generator=gen) / d_in**0.5).to(device, ad).requires_grad_(True)
    B = (torch.randn(d_out, r, generator=gen) / r**0.5).to(device, ad).requires_grad_(True)
    return LoRAParams(w, b, A, B, 2.0, p)


def _setup(lead, d, inter, r, bias, p, dtype, seed=0, lora_on=(True, True, True), device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=gen).to(device, dtype).requires_grad_(True)
    ranks = [r if on else None for on in lora_on]
    gate = _proj(gen, d, inter, ranks[0], bias, dtype, p, device=device)
    up = _proj(gen, d, inter, ranks[1], bias, dtype, p, device=device)
    down = _proj(gen, inter, d, ranks[2], bias, dtype, p, device=device)
    g = torch.randn(*lead, d, generator=gen).to(device, dtype)
    return x, (gate, up, down), g


def _noises(x, params, inter, seed):
    """The dropout multipliers the op draws after ``manual_seed(seed)``: gate, up, down order."""
    torch.manual_seed(seed)
    out = []
    for p, shape in zip(params, (x.shape, x.shape, (*x.shape[:-1], inter))):
        if p.lora_A is None or p.dropout_p == 0.0:
            out.append(None)
            continue
        keep = 1.0 - p.dropout_p
        out.append(
            torch.empty(shape, dtype=p.lora_A.dtype, device=x.device).bernoulli_(keep).div_(keep)
        )
    return out


def _leaves(x, params):
    return [x] + [t for p in params for t in (p.bias, p.lora_A, p.lora_B) if t is not None]


def _grads(y, g, leaves):
    return torch.autograd.grad(y, leaves, g)


def _compare(params, x, g, backend, inter, up_cast=None, *, atol, rtol, seed=7, activation="silu"):
    torch.manual_seed(seed)
    y = lora_mlp(x, *params, backend=backend, activation=activation)
    got = _grads(y, g, _leaves(x, params))
    noises = _noises(x, params, inter, seed)
    if up_cast is not None:  # oracle on fp32 copies of the same values
        x, params, g = up_cast(x), [up_cast(p) for p in params], g.float()
        noises = [n if n is None else n.float() for n in noises]
    ry = lora_mlp_reference(x, *params, noises=noises, activation=activation)
    want = _grads(ry, g, _leaves(x, params))
    assert_close(y, ry, atol=atol(ry), rtol=rtol, name="y")
    names = ["dx"] + [f"d{n}" for n in ("bias", "A", "B") for _ in range(1)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, atol=atol(b), rtol=rtol, name=f"grad[{i}] ({names[min(i, 1)]}...)")


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("r", [1, 8, 16, 64])
# bias and dropout paired (each seen on and off per rank and shape) to halve the grid's time
@pytest.mark.parametrize("bias, p", [(False, 0.0), (True, 0.25)])
def test_lora_mlp_fp32(backend, device, shape, r, bias, p):
    lead, d, inter = shape
    if r == 64 and d > 200:
        d = 96  # rank 64 on the small shape only (time budget)
    x, params, g = _setup(lead, d, inter, r, bias, p, torch.float32, device=device)
    # fp32 vs fp32 autograd: same products, different association (bracketing through rank r,
    # fused activation); sums run over <= 1023 terms, so ~1e-5 relative plus a floor at 1e-5
    # of the tensor's own scale for entries that cancel to near zero.
    _compare(params, x, g, backend, inter, atol=lambda t: 1e-5 * t.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_lora_mlp_bf16_against_fp32_oracle(backend, device, p):
    x, params, g = _setup((2, 5), 48, 40, 8, True, p, torch.bfloat16, device=device)

    def up_cast(t):
        if isinstance(t, LoRAParams):
            return t._replace(
                **{k: up_cast(getattr(t, k)) for k in ("weight", "bias", "lora_A", "lora_B")}
            )
        if t is None:
            return None
        return t.detach().float().requires_grad_(t.requires_grad)

    # Three chained bf16 GEMM layers, each rounding its (N, ·) output to bf16 (2^-9 relative)
    # and feeding the next; gradients pass through ~5 such roundings. 3e-2 of each tensor's
    # scale bounds that chain (measured worst ~1e-2); rtol covers the large entries.
    _compare(
        params, x, g, backend, 40, up_cast, atol=lambda t: 3e-2 * t.abs().max().item(), rtol=3e-2
    )


@pytest.mark.parametrize(
    "lora_on", [(True, False, True), (False, False, True), (False, False, False)]
)
def test_lora_mlp_partial_lora_and_plain_projections(lora_on):
    x, params, g = _setup((2, 7), 32, 24, 4, True, 0.0, torch.float32, lora_on=lora_on)
    _compare(params, x, g, "torch", 24, atol=lambda t: 1e-5 * t.abs().max().item(), rtol=1e-5)


def test_lora_mlp_quantized_weights_dequantized_in_forward_and_backward():
    x, params, g = _setup((2, 3), 32, 24, 4, False, 0.0, torch.float32)
    fakes = [FakeQuant(p.weight) for p in params]
    qparams = [p._replace(weight=f) for p, f in zip(params, fakes)]
    y = lora_mlp(x, *qparams, backend="torch")
    assert [f.calls for f in fakes] == [1, 1, 1]
    got = _grads(y, g, _leaves(x, params))
    assert [f.calls for f in fakes] == [2, 2, 2]  # again in backward, none saved
    ry = lora_mlp_reference(x, *params)
    want = _grads(ry, g, _leaves(x, params))
    assert_close(y, ry, atol=1e-6, rtol=1e-5, name="y")
    for a, b in zip(got, want):
        assert_close(a, b, atol=1e-6, rtol=1e-5, name="grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_mlp_keeps_at_most_one_dense_weight_alive(dtype):
    """QLoRA's memory promise: forward and backward dequantize one projection at a time, on the
    per-projection path and (bf16 base with PEFT's fp32 adapters, where bf16 products are
    native) the stacked gate/up one."""
    import gc

    x, params, g = _setup((2, 3), 32, 24, 4, False, 0.0, dtype)
    params = [
        p._replace(lora_A=p.lora_A.detach().float().requires_grad_(True),
                   lora_B=p.lora_B.detach().float().requires_grad_(True))
        for p in params
    ]  # fmt: skip
    qparams = [p._replace(weight=FakeQuant(p.weight)) for p in params]
    gc.collect()
    FakeQuant.reset_alive()
    lora_mlp(x, *qparams, backend="torch").backward(g)
    gc.collect()
    assert FakeQuant.peak_alive == 1 and FakeQuant.alive == 0


@pytest.mark.parametrize("backend, device", CASES)
def test_lora_mlp_backward_writes_dgate_into_dh(backend, device, monkeypatch):
    """The activation's backward takes dh's buffer for d gate: four (N, I) tensors alive there
    (gate, up, their gradients), not five; gradients unchanged (the reference test above)."""
    from lorafuse.ops import swiglu as swiglu_module

    real = swiglu_module.implementation
    reused = []

    def watched(backend):
        fwd, bwd = real(backend)

        def bwd_watched(g, gate, up, **kw):
            dgate, dup = bwd(g, gate, up, **kw)
            reused.append(dgate.data_ptr() == g.data_ptr())
            return dgate, dup

        return fwd, bwd_watched

    monkeypatch.setattr(swiglu_module, "implementation", watched)
    x, params, g = _setup((2, 5), 48, 40, 4, False, 0.0, torch.float32, device=device)
    lora_mlp(x, *params, backend=backend).backward(g)
    assert reused == [True]


def test_lora_mlp_does_not_save_the_activation():
    """Saved tensors: x, gate, up (N, I) once each — never h = silu(gate)*up."""
    x, params, g = _setup((4, 8), 40, 24, 4, False, 0.0, torch.float32)  # N=32, d=40, I=24
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lora_mlp(x, *params, backend="torch")
    big = [t for t in saved if t.dim() == 2 and t.shape[1] == 24 and t.shape[0] == 32]
    assert len(big) == 2, [tuple(t.shape) for t in saved]  # gate and up, nothing else (N, I)
    assert sum(t is x or t.data_ptr() == x.data_ptr() for t in saved) == 1
    y.backward(g)


def test_lora_mlp_matches_peft_llama_mlp_with_seeded_dropout():
    from peft import LoraConfig, get_peft_model
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    cfg = tiny_llama_config()
    base = torch.nn.Sequential()
    base.add_module("mlp", LlamaMLP(cfg))
    lcfg = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.3, target_modules=["gate_proj", "up_proj", "down_proj"]
    )
    model = get_peft_model(base, lcfg)
    model.train()
    for n, prm in model.named_parameters():  # non-zero B so every gradient path is exercised
        if "lora_B" in n:
            torch.nn.init.normal_(prm, std=0.1)
    mlp = model.base_model.model.mlp
    x = torch.randn(2, 9, cfg.hidden_size, requires_grad=True)
    g = torch.randn_like(x)

    def params(m):
        return LoRAParams(
            m.base_layer.weight,
            m.base_layer.bias,
            m.lora_A["default"].weight,
            m.lora_B["default"].weight,
            m.scaling["default"],
            0.3,
        )

    loras = [p for n, p in model.named_parameters() if "lora_" in n]
    torch.manual_seed(11)
    ry = mlp(x)
    want = torch.autograd.grad(ry, [x, *loras], g)
    torch.manual_seed(11)
    y = lora_mlp(x, params(mlp.gate_proj), params(mlp.up_proj), params(mlp.down_proj))
    got = torch.autograd.grad(y, [x, *loras], g)
    assert_close(y, ry, atol=1e-5, rtol=1e-5, name="y")
    for a, b in zip(got, want):
        assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-5, name="grad")


def test_lora_mlp_errors_name_the_problem():
    x, (gate, up, down), _ = _setup((2,), 16, 12, 4, False, 0.0, torch.float32)
    with pytest.raises(ValueError, match=r"down.weight must be \(16, 12\)"):
        lora_mlp(x, gate, up, down._replace(weight=torch.randn(15, 12)))
    with pytest.raises(ValueError, match=r"up.lora_B must be \(12, 4\)"):
        lora_mlp(x, gate, up._replace(lora_B=torch.randn(12, 5)), down)
    with pytest.raises(ValueError, match="gate.weight dtype"):
        lora_mlp(x, gate._replace(weight=gate.weight.double()), up, down)
    with pytest.raises(ValueError, match="frozen"):
        lora_mlp(x, gate._replace(weight=gate.weight.clone().requires_grad_(True)), up, down)
    with pytest.raises(ValueError, match="both be given"):
        lora_mlp(x, gate._replace(lora_B=None), up, down)


# ---- gate/up stacked: one x·[A_gate; A_up]ᵀ for the two adapters on x (lora_params) ----------
STACKING = [c for c in CASES if c.values[0] in ("torch", "cpp")]  # Triton keeps one per projection


def _count_stacked(monkeypatch) -> list:
    return count_calls(monkeypatch, lora_mlp_module, "split_forward")


def _ranked(ranks, dtype, adapter_dtype, lead=(3, 11), d=40, inter=56, seed=2):
    """x, (gate, up, down), grad; ``ranks[i]`` None: no adapter on that projection."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=gen).to(dtype).requires_grad_(True)
    shapes = ((d, inter), (d, inter), (inter, d))
    params = tuple(
        _proj(gen, i, o, r, True, dtype, 0.0, adapter_dtype) for (i, o), r in zip(shapes, ranks)
    )
    return x, params, torch.randn(*lead, d, generator=gen).to(dtype)


def _apply(x, params, backend, stacked):
    x2 = x.reshape(-1, x.shape[-1])  # (N, d)
    return LoRAMLPFunction.apply(x2, *flatten(params), meta_of(params), backend, backend, "silu",
                                 stacked)  # fmt: skip


@pytest.mark.parametrize("backend, device", STACKING)
# all three; down without adapter; a different rank per projection (PEFT's rank_pattern)
@pytest.mark.parametrize("ranks", [(8, 8, 8), (8, 8, None), (3, 16, 5)])
def test_lora_mlp_stacked_gate_up_equals_per_projection(backend, device, ranks, monkeypatch):
    calls = _count_stacked(monkeypatch)
    x, params, g = _ranked(ranks, torch.float32, torch.float32)
    g2 = g.reshape(-1, g.shape[-1])  # (N, d)
    y = _apply(x, params, backend, True)
    got = _grads(y, g2, _leaves(x, params))
    assert calls == [1]  # stacked=True took the stacked path
    per = _apply(x, params, backend, False)
    want = _grads(per, g2, _leaves(x, params))
    assert calls == [1]  # stacked=False ran one lora_linear kernel per projection
    # fp32 both ways: same products, summed in another order -> 1e-5 of each tensor's scale.
    assert_close(y, per, atol=1e-5 * per.abs().max().item(), rtol=1e-5, name="y")
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-5, name=f"grad[{i}]")


@pytest.mark.parametrize("backend, device", STACKING)
def test_lora_mlp_stacked_bf16_base_fp32_adapters_against_fp32_oracle(backend, device):
    """PEFT's default on a bf16 model (fp32 adapters): x is cast to fp32 once for gate and up."""
    x, params, g = _ranked((8, 4, 8), torch.bfloat16, torch.float32)
    y = _apply(x, params, backend, True)
    got = _grads(y, g.reshape(y.shape), _leaves(x, params))

    def up(t):
        return None if t is None else t.detach().float().requires_grad_(t.requires_grad)

    xf = up(x)
    pf = [p._replace(weight=up(p.weight), bias=up(p.bias), lora_A=up(p.lora_A),
                     lora_B=up(p.lora_B)) for p in params]  # fmt: skip
    ry = lora_mlp_reference(xf, *pf)
    want = _grads(ry, g.float(), _leaves(xf, pf))
    # Three chained bf16 base GEMMs, each rounding its output (2^-9 relative), as the bf16 oracle
    # test above; the fp32 adapter products add no rounding of their own: 3e-2 of scale.
    ry = ry.reshape(y.shape)
    assert_close(y.float(), ry, atol=3e-2 * ry.abs().max().item(), rtol=3e-2, name="y")
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a.float(), b, atol=3e-2 * b.abs().max().item(), rtol=3e-2, name=f"grad[{i}]")


def test_lora_mlp_stacks_gate_up_only_where_it_measured_faster(monkeypatch):
    """Stacked only when the LoRA products run in another dtype than the base's (fp32 adapters
    on a bf16 base with native bf16 GEMMs); there lora_mlp takes the stacked path."""
    bf16, f32 = torch.bfloat16, torch.float32
    monkeypatch.setenv("LORAFUSE_CPU_LOW_PRECISION", "native")
    for dtype, adapter, want in ((bf16, f32, True), (bf16, bf16, False), (f32, f32, False)):
        x, (gate, up, _), _ = _ranked((8, 8, 8), dtype, adapter)
        assert stack_gate_up(gate, up, "cpp", x) is want, (dtype, adapter)
    assert not stack_gate_up(gate, up, "triton", x)
    x, params, g = _ranked((8, 8, 8), bf16, f32)
    assert not stack_gate_up(params[0], params[1]._replace(dropout_p=0.1), "cpp", x)
    calls = _count_stacked(monkeypatch)
    _grads(lora_mlp(x, *params, backend="torch"), g, _leaves(x, params))
    assert calls == [1]
    monkeypatch.setenv("LORAFUSE_CPU_LOW_PRECISION", "emulated")  # both products in fp32
    assert not stack_gate_up(params[0], params[1], "cpp", x)


@pytest.mark.parametrize("ranks, p", [((None, 8, 8), 0.0), ((8, 8, 8), 0.2)])
def test_lora_mlp_keeps_per_projection_kernels_without_a_shared_input(ranks, p, monkeypatch):
    """One adapter on x (nothing to stack), or dropout (each draws its own mask on x)."""
    calls = _count_stacked(monkeypatch)
    x, params, g = _ranked(ranks, torch.float32, torch.float32)
    params = [q._replace(dropout_p=p) if q.has_lora else q for q in params]
    _grads(lora_mlp(x, *params, backend="torch"), g, _leaves(x, params))
    assert calls == []


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("bias, p", [(False, 0.0), (True, 0.25)])
def test_lora_mlp_geglu_fp32(backend, device, bias, p):
    """Gemma's GeGLU (tanh GELU): the fused MLP with the gelu_tanh activation kernel, against
    autograd through Gemma's formula; same bound as the SwiGLU one."""
    x, params, g = _setup((3, 37), 129, 97, 8, bias, p, torch.float32, device=device)
    _compare(params, x, g, backend, 97, atol=lambda t: 1e-5 * t.abs().max().item(), rtol=1e-5,
             activation="gelu_tanh")  # fmt: skip


def test_geglu_kernel_is_autograd_of_gemmas_formula_and_bad_activations_are_refused():
    from lorafuse.ops.geglu import geglu_backward, geglu_forward, geglu_reference

    gen = torch.Generator().manual_seed(4)
    z, u, g = (torch.randn(5, 9, dtype=torch.float64, generator=gen) * 3 for _ in range(3))
    z.requires_grad_(True)
    u.requires_grad_(True)
    dz, du = torch.autograd.grad(geglu_reference(z, u), (z, u), g)
    kz, ku = geglu_backward(g.float(), z.detach().float(), u.detach().float())
    ref = geglu_reference(z, u).detach().float()
    # fp32 kernel vs the float64 oracle: a few fp32 roundings
    assert_close(geglu_forward(z.detach().float(), u.detach().float()), ref, atol=1e-5, rtol=1e-5)
    assert_close(kz, dz.float(), atol=1e-5, rtol=1e-5, name="dgate")
    assert_close(ku, du.float(), atol=1e-5, rtol=1e-5, name="dup")
    x, params, _ = _setup((2, 3), 8, 12, 2, False, 0.0, torch.float32)
    with pytest.raises(ValueError, match="activation must be one of"):
        lora_mlp(x, *params, activation="relu")
