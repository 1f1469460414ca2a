"""moe_lora against its reference (transformers' expert loop on PEFT's dense W + s·B·A), every
backend: output, dx, the router weights' gradient and every expert's LoRA dA / dB; SwiGLU halves
(Qwen3-MoE, Granite, LFM2) and gpt-oss's clamped, interleaved, transposed experts with biases;
experts that receive no token; tied router weights; one token."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops.moe_lora import Activation, ExpertStack, moe_lora, moe_lora_reference
from lorafuse.testing import assert_close, op_cases
from lorafuse.testing.numerics import rms_error

CASES = op_cases("moe_lora")
QWEN = Activation("swiglu")
GPT_OSS = Activation("clamped_swiglu", interleaved=True, alpha=1.702, limit=1.5)


def _stack(e, out_dim, in_dim, r, transposed, bias, gen, scale=0.3):
    shape = (e, in_dim, out_dim) if transposed else (e, out_dim, in_dim)
    w = torch.randn(shape, generator=gen) * scale
    b = torch.randn(e, out_dim, generator=gen) * 0.1 if bias else None
    if r == 0:
        return ExpertStack(w, b, None, None, 1.0, transposed)
    a = torch.randn(e, r, in_dim, generator=gen) * 0.3
    bb = torch.randn(e, out_dim, r, generator=gen) * 0.3  # nonzero: B's gradient path matters
    return ExpertStack(w, b, a, bb, 2.0 / r, transposed)


def _routing(t, e, k, gen, skip=(), ties=False):
    """Top-k of random logits over the experts not in ``skip`` (those get no token); ``ties``:
    every token's k weights equal (softmax of equal top logits)."""
    logits = torch.randn(t, e, generator=gen)
    logits[:, list(skip)] = -1e9
    top, idx = logits.topk(k, dim=-1)
    if ties:
        top = torch.zeros_like(top)
    return idx, torch.softmax(top, dim=-1)


def _case(t=37, h=24, i=10, e=5, k=2, r=3, act=QWEN, skip=(4,), ties=False, r_down=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen) * (3.0 if act.kind == "clamped_swiglu" else 1.0)
    tr, bias = act.kind == "clamped_swiglu", act.kind == "clamped_swiglu"
    gu = _stack(e, 2 * i, h, r, tr, bias, gen)
    down = _stack(e, h, i, r if r_down is None else r_down, tr, bias, gen)
    idx, w = _routing(t, e, k, gen, skip, ties)
    g = torch.randn(t, h, generator=gen)
    return x, idx, w, gu, down, act, g


def _leaves(x, w, gu, down, dtype):
    def stack(p):
        lora = [None if t is None else t.detach().clone().requires_grad_() for t in (p.lora_A, p.lora_B)]  # fmt: skip
        bias = None if p.bias is None else p.bias.to(dtype)
        return ExpertStack(p.weight.to(dtype), bias, *lora, p.scaling, p.transposed)

    xl = x.detach().to(dtype).clone().requires_grad_()
    wl = w.detach().to(dtype).clone().requires_grad_()
    return xl, wl, stack(gu), stack(down)


def _run(fn, x, idx, w, gu, down, act, g, dtype=torch.float32):
    xl, wl, gl, dl = _leaves(x, w, gu, down, dtype)
    out = fn(xl, idx, wl, gl, dl, act)
    out.backward(g.to(dtype))
    grads = [xl.grad, wl.grad]
    grads += [t.grad for p in (gl, dl) for t in (p.lora_A, p.lora_B) if t is not None]
    return out, grads


NAMES = ["dx", "dw", "dA_gu", "dB_gu", "dA_down", "dB_down"]
VARIANTS = {
    "swiglu": dict(),
    "swiglu-ties": dict(ties=True),
    "swiglu-down-only-lora": dict(r=0, r_down=4),
    "swiglu-one-token-top1": dict(t=1, k=1, skip=()),
    "gpt-oss-clamped": dict(act=GPT_OSS, r=2, e=4, skip=(1,)),
    "no-lora": dict(r=0),
}


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_lora_fp32_equals_reference(backend, device, variant):
    x, idx, w, gu, down, act, g = _case(**VARIANTS[variant])
    out, grads = _run(lambda *a: moe_lora(*a, backend=backend), x, idx, w, gu, down, act, g)
    ref, rgrads = _run(moe_lora_reference, x, idx, w, gu, down, act, g)
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name="out")
    assert len(grads) == len(rgrads)
    for name, a, b in zip(NAMES, grads, rgrads):
        assert_close(a, b, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_experts_without_tokens_get_zero_lora_gradients(backend, device):
    x, idx, w, gu, down, act, g = _case(skip=(1, 4))
    _, grads = _run(lambda *a: moe_lora(*a, backend=backend), x, idx, w, gu, down, act, g)
    for grad in grads[2:]:
        assert grad[1].abs().max() == 0 and grad[4].abs().max() == 0
        assert grad[0].abs().max() > 0


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("variant", ["swiglu", "gpt-oss-clamped"])
def test_moe_lora_bf16_as_accurate_as_stock(backend, device, variant):
    x, idx, w, gu, down, act, g = _case(**VARIANTS[variant])
    # Every input rounded to bf16 once, so the oracle and both runs see the same values.
    x, w = x.bfloat16().float(), w.bfloat16().float()
    gu = gu._replace(weight=gu.weight.bfloat16().float())
    down = down._replace(weight=down.weight.bfloat16().float())
    if act.kind == "clamped_swiglu":
        act = act._replace(limit=_clear_limit(x, gu))
    ours, ograds = _run(lambda *a: moe_lora(*a, backend=backend), x, idx, w, gu, down, act, g,
                        torch.bfloat16)  # fmt: skip
    stock, sgrads = _run(moe_lora_reference, x, idx, w, gu, down, act, g, torch.bfloat16)
    oracle, rgrads = _run(moe_lora_reference, x, idx, w, gu, down, act, g)
    assert ours.dtype == torch.bfloat16
    for name, a, b, o in zip(["out", *NAMES], [ours, *ograds], [stock, *sgrads], [oracle, *rgrads]):
        # bf16 rounding moves both from the oracle; ours rounds later (fp32 rank products and
        # accumulation), so it may not be further than stock, with 1.5x room for the noise of a
        # few hundred rounding errors.
        assert rms_error(a, o) <= 1.5 * rms_error(b, o) + 1e-6, name


def _clear_limit(x, gu):
    """A clamp limit that clamps some gate/up values but lies 4 bf16 ulps from every one of them: a
    value within a bf16 ulp of the limit may round to either side, and the gradient jumps there
    (0 beyond, the full one inside) for stock and ours alike, which is not accuracy."""
    w = gu.weight + gu.scaling * (gu.lora_B @ gu.lora_A).transpose(1, 2)  # (E, H, 2I)
    v = (torch.einsum("th,eho->teo", x, w) + gu.bias).abs().flatten()
    candidates = torch.linspace(1.0, 0.9 * float(v.max()), 2000)
    gap = (v[None, :] - candidates[:, None]).abs().amin(dim=1) / candidates  # relative
    best = int(gap.argmax())
    assert gap[best] > 2**-6 and (v > candidates[best]).any()  # 4 bf16 ulps
    return float(candidates[best])


def test_moe_lora_float64_gradcheck():
    x, idx, w, gu, down, act, _ = _case(t=6, h=5, i=3, e=3, r=2, skip=(2,))
    xl, wl, gl, dl = _leaves(x, w, gu, down, torch.float64)
    gl = gl._replace(lora_A=gl.lora_A.double(), lora_B=gl.lora_B.double())
    dl = dl._replace(lora_A=dl.lora_A.double(), lora_B=dl.lora_B.double())

    def f(xx, ww, a1, b1, a2, b2):
        return moe_lora(xx, idx, ww, gl._replace(lora_A=a1, lora_B=b1),
                        dl._replace(lora_A=a2, lora_B=b2), act, backend="torch")  # fmt: skip

    leaves = [t.detach().requires_grad_() for t in (xl, wl, gl.lora_A, gl.lora_B, dl.lora_A, dl.lora_B)]  # fmt: skip
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6)


def test_bad_inputs_name_the_problem():
    x, idx, w, gu, down, act, _ = _case()
    with pytest.raises(ValueError, match="expert indices"):
        moe_lora(x, idx + 3, w, gu, down, act)
    with pytest.raises(ValueError, match="takes 24 inputs"):
        moe_lora(x[:, :20], idx, w, gu, down, act)
    with pytest.raises(ValueError, match="trainable"):
        moe_lora(x, idx, w, gu._replace(weight=gu.weight.requires_grad_()), down, act)


@pytest.mark.parametrize("backend, device", CASES)
def test_moe_lora_compiles_to_one_node_without_graph_breaks(backend, device):
    x, idx, w, gu, down, act, g = _case(t=9, h=8, i=4, e=3, r=2, skip=(2,))

    def f(*a):
        return moe_lora(*a, backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # a graph break raises
    out, grads = _run(compiled, x, idx, w, gu, down, act, g)
    ref, rgrads = _run(moe_lora_reference, x, idx, w, gu, down, act, g)
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name="out")
    for name, a, b in zip(NAMES, grads, rgrads):
        assert_close(a, b, atol=1e-5, rtol=1e-5, name=name)
