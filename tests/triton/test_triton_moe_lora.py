"""Triton expert LoRA (triton/moe_lora.py) against the torch body of the op (ops/moe_lora_groups):
output, the saved gate/up products, dx, the router weights' gradient and every expert's LoRA dA /
dB; SwiGLU halves (Qwen3-MoE) and gpt-oss's clamped, interleaved, transposed experts with biases;
experts with no token, tied router choices, uneven groups spanning several row tiles (the
interpreter's tiles are 16 rows, 16 columns, 16 deep)."""

from __future__ import annotations

import pytest
import torch
from tritonlib import DEVICE, interpret_on_cpu  # noqa: F401  (fixture)

from lorafuse.ops import moe_lora_groups as groups
from lorafuse.ops.moe_lora import Activation, ExpertStack, moe_lora, moe_lora_reference
from lorafuse.testing.numerics import rms_error
from lorafuse.triton import moe_lora as tri

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpret_on_cpu")]

QWEN = Activation("swiglu")
GPT_OSS = Activation("clamped_swiglu", interleaved=True, alpha=1.702, limit=1.5)
NAMES = ("dx", "dws", "dA_gu", "dB_gu", "dA_down", "dB_down")
# t tokens, h hidden, i expert width, e experts, k per token, r rank; ``skip``: experts that get
# no token; ``ties``: equal router logits for the first k+1 experts of every token (top-k picks
# by index, the weights are equal). 45 tokens x 2 over 4 experts: groups of 17-30 rows, two row
# tiles each; h 40 and i 24: three K tiles, two column tiles of h and of i.
VARIANTS = {
    "swiglu": dict(),
    "swiglu-ties": dict(ties=True, skip=()),
    "swiglu-down-only-lora": dict(r=0, r_down=5),
    "swiglu-no-lora": dict(r=0),
    "swiglu-one-token-top1": dict(t=1, k=1, skip=()),
    "gpt-oss-clamped": dict(act=GPT_OSS, r=2),
}


def _stack(e, out_dim, in_dim, r, transposed, bias, gen):
    shape = (e, in_dim, out_dim) if transposed else (e, out_dim, in_dim)
    w = torch.randn(shape, generator=gen) * in_dim**-0.5
    b = torch.randn(e, out_dim, generator=gen) * 0.1 if bias else None
    if r == 0:
        return ExpertStack(w, b, None, None, 1.0, transposed)
    a = torch.randn(e, r, in_dim, generator=gen) * in_dim**-0.5
    # B as PEFT stores it ((out, r·E) viewed (E, out, r): not contiguous), nonzero
    bb = (torch.randn(out_dim, r, e, generator=gen) * r**-0.5).permute(2, 0, 1)
    return ExpertStack(w, b, a, bb, 2.0 / r, transposed)


def _case(t=45, h=40, i=24, e=5, k=2, r=3, act=QWEN, skip=(3,), ties=False, r_down=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen) * (3.0 if act.kind == "clamped_swiglu" else 1.0)
    clamped = act.kind == "clamped_swiglu"
    gu = _stack(e, 2 * i, h, r, clamped, clamped, gen)
    down = _stack(e, h, i, r if r_down is None else r_down, clamped, clamped, gen)
    logits = torch.randn(t, e, generator=gen)
    if ties:
        logits[:, : k + 1] = 5.0
    logits[:, list(skip)] = -1e9
    top, idx = logits.topk(k, dim=-1)
    g = torch.randn(t, h, generator=gen)
    return x, idx, torch.softmax(top, dim=-1), gu, down, act, g


def _on(stack: ExpertStack, dtype) -> ExpertStack:
    def mv(t, dt):
        return None if t is None else t.to(device=DEVICE, dtype=dt)

    lora = stack.lora_A.dtype if stack.lora_A is not None else dtype  # adapters stay fp32
    return stack._replace(weight=mv(stack.weight, dtype), bias=mv(stack.bias, dtype),
                          lora_A=mv(stack.lora_A, lora), lora_B=mv(stack.lora_B, lora))  # fmt: skip


def _contract_args(x, idx, w, gu, down, dtype):
    """The contract's arguments: the routed pairs sorted by expert, as the op hands them over."""
    order, counts = groups.route(idx, gu.weight.shape[0])
    tok = torch.div(order, idx.shape[1], rounding_mode="floor").to(DEVICE)
    ws = w.reshape(-1)[order].to(DEVICE, dtype)
    return x.to(DEVICE, dtype), tok, ws, counts, _on(gu, dtype), _on(down, dtype)


IMPLS = {"triton": (tri.forward, tri.backward), "torch": (groups.forward, groups.backward)}


def _both(case, dtype=torch.float32, need=(True, True, True), saved=True, impls=tuple(IMPLS)):
    """``{impl: (out, z, xa, grads)}`` for the Triton kernels and the torch body, same inputs."""
    x, idx, w, gu, down, act, g = case
    args = _contract_args(x, idx, w, gu, down, dtype)
    results = {}
    for name in impls:
        fwd, bwd = IMPLS[name]
        out, (z, xa) = fwd(*args, act, save=True)
        keep = (z, xa) if saved else (None, None)
        grads = bwd(g.to(DEVICE, dtype), *args, act, *need, keep)
        results[name] = (out, z, xa, grads)
    return results


def _compare(close, got, ref):
    """fp32: only the order of the fp32 sums differs, so 1e-5 of each tensor's largest element
    (gpt-oss's gradients reach 100 from sums that cancel: both sides lie ~2e-7 of that from an
    fp64 run of the torch body)."""
    out, z, xa, grads = got
    rout, rz, rxa, rgrads = ref
    assert (xa is None) == (rxa is None)
    pairs = [("out", out, rout), ("z", z, rz), ("xa", xa, rxa), *zip(NAMES, grads, rgrads)]
    for name, a, e in pairs:
        assert (a is None) == (e is None), name
        if e is not None:
            scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
            close(a.float(), e.float(), atol=1e-5 * scale, rtol=1e-5, name=name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_equals_torch_body(close, variant):
    res = _both(_case(**VARIANTS[variant]))
    _compare(close, res["triton"], res["torch"])


def test_backward_recomputes_what_was_not_saved(close):
    """The custom op (torch.compile) saves nothing: backward recomputes z and xa from x."""
    res = _both(_case(act=GPT_OSS, r=2), saved=False)
    _compare(close, res["triton"], res["torch"])


def test_experts_without_tokens_get_exactly_zero_gradients(close):
    res = _both(_case(skip=(1, 3)))
    _compare(close, res["triton"], res["torch"])
    for grad in res["triton"][3][2:]:
        assert grad[1].abs().max() == 0 and grad[3].abs().max() == 0
        assert grad[0].abs().max() > 0 and grad[2].abs().max() > 0


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True)])
def test_only_requested_gradients(close, need):
    res = _both(_case(), need=need)
    _compare(close, res["triton"], res["torch"])
    dx, dws, *lora = res["triton"][3]
    assert (dx is None) != need[0] and (dws is None) != need[1]
    assert all((t is None) != need[2] for t in lora)


@pytest.mark.parametrize(
    "dtype, variant",
    [(torch.bfloat16, "swiglu"), (torch.bfloat16, "gpt-oss-clamped"),
     (torch.float16, "swiglu-ties")],
)  # fmt: skip
def test_low_precision_as_accurate_as_torch(dtype, variant):
    """bf16/fp16 inputs: the Triton kernels and the torch body in that dtype, each against the
    torch body in fp32 on the same rounded inputs (the oracle), the kernels no further from it.
    Both round z, h and the outputs to the dtype; the torch body also rounds each base product
    before the LoRA term is added and each expert's output before the router weight, the
    kernels accumulate those in fp32. rms over all elements: a max over a few hundred rounding
    errors is too noisy for a ratio. Measured kernels / torch: 0.48-1.01 over every tensor of the
    three variants in bf16 and fp16 (gpt-oss's dx and dA_gu 1.00-1.01: the clamp's edges); 1.25x
    leaves room for that noise."""
    x, idx, w, gu, down, act, g = _case(**VARIANTS[variant])
    rounded = [t.to(dtype).float() for t in (x, w, gu.weight, down.weight, g)]
    x, w, g = rounded[0], rounded[1], rounded[4]
    gu, down = gu._replace(weight=rounded[2]), down._replace(weight=rounded[3])
    if gu.bias is not None:
        gu = gu._replace(bias=gu.bias.to(dtype).float())
        down = down._replace(bias=down.bias.to(dtype).float())
    low = _both((x, idx, w, gu, down, act, g), dtype)
    oracle = _both((x, idx, w, gu, down, act, g), impls=("torch",))["torch"]
    ours, stock = low["triton"], low["torch"]
    assert ours[0].dtype == dtype
    flat = [(n, o, s, r) for n, o, s, r in zip(("out", "z"), ours, stock, oracle)]
    flat += list(zip(NAMES, ours[3], stock[3], oracle[3]))
    for name, o, s, r in flat:
        if r is None:
            continue
        err, ref_err = rms_error(o, r), rms_error(s, r)
        assert err <= 1.25 * ref_err + 1e-7, f"{name}: triton {err:.3e}, torch {ref_err:.3e}"


@pytest.mark.parametrize("variant", ["swiglu-ties", "gpt-oss-clamped"])
def test_op_with_triton_backend_equals_reference(close, variant):
    """moe_lora(backend='triton') through autograd against the stock-PEFT-style oracle."""
    x, idx, w, gu, down, act, g = _case(**VARIANTS[variant])
    results = []
    for fn in (lambda *a: moe_lora(*a, backend="triton"), moe_lora_reference):
        xl, wl = (t.to(DEVICE).clone().requires_grad_() for t in (x, w))
        gl, dl = (_on(p, torch.float32) for p in (gu, down))
        gl, dl = (p._replace(lora_A=p.lora_A.clone().requires_grad_(),
                             lora_B=p.lora_B.clone().requires_grad_()) for p in (gl, dl))  # fmt: skip
        leaves = [t for p in (gl, dl) for t in (p.lora_A, p.lora_B)]
        out = fn(xl, idx.to(DEVICE), wl, gl, dl, act)
        out.backward(g.to(DEVICE))
        results.append([out, xl.grad, wl.grad, *(t.grad for t in leaves)])
    for name, a, e in zip(("out", "dx", "dw", *NAMES[2:]), *results):
        close(a, e, atol=1e-5, rtol=1e-5, name=name)


def test_nf4_experts_on_a_triton_request_run_torch_and_say_so(close):
    """The kernels read dense stacks: NF4 experts asked to run on Triton run the torch body, with
    one warning naming why (never a silent swap)."""
    from lorafuse import backends
    from lorafuse.models.nf4_experts import NF4Experts, quantize_stack

    x, idx, w, gu, down, act, _ = _case(t=6, skip=())

    def nf4(p):
        buffers = quantize_stack(p.weight)
        return p._replace(weight=NF4Experts(*buffers.values(), p.weight.shape, torch.float32))

    gu, down = nf4(_on(gu, torch.float32)), nf4(_on(down, torch.float32))
    args = (x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE), gu, down, act)
    with pytest.warns(RuntimeWarning, match="NF4 expert weights"):
        out = moe_lora(*args, backend="triton")
    assert backends.choices()[f"moe_lora ({DEVICE.type})"].startswith("torch: NF4")
    close(out, moe_lora(*args, backend="torch"), atol=0, rtol=0, name="out")
