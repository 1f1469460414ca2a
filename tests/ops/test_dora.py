"""dora_linear against stock PEFT DoRA (output and every gradient, magnitude included), the fp32
oracle (bf16, autocast), NF4 bases (QDoRA, whole and by tiles) and fp64 (the weight norm)."""

from __future__ import annotations

import peft
import pytest
import torch
from torch import nn

from lorafuse.models import nf4
from lorafuse.ops import dora, weights
from lorafuse.ops.dora import dora_linear, dora_linear_reference, weight_norm
from lorafuse.testing import assert_close, op_cases, single_thread

CASES = op_cases("dora_linear")
# (leading shape, d in, k out): odd sizes, one long row
SHAPES = [((1, 1), 1023, 65), ((3, 37), 129, 97)]


@pytest.fixture(autouse=True)
def _one_thread():
    yield from single_thread()  # tiny shapes: threads only add barrier waits on a shared box


def _peft_dora(d, k, r, bias, p, dtype=torch.float32, adapter_dtype=None, seed=0):
    """A stock PEFT DoRA Linear with non-trivial B and magnitude (B = 0 would make n = ||W||
    and m/n = 1: every DoRA term but dm trivial)."""
    torch.manual_seed(seed)
    base = nn.Sequential()
    base.add_module("proj", nn.Linear(d, k, bias=bias))
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=p, target_modules=["proj"],
                          use_dora=True)  # fmt: skip
    model = peft.get_peft_model(base, cfg).train()
    lin = model.base_model.model.proj
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        lin.lora_B["default"].weight.copy_(torch.randn(k, r, generator=gen) * 0.3)
        mag = lin.lora_magnitude_vector["default"].weight
        mag.mul_(0.5 + torch.rand(k, generator=gen))
    lin.to(dtype)
    if adapter_dtype is not None:
        for t in _adapter(lin):
            t.data = t.data.to(adapter_dtype)
    return lin


def _adapter(lin):
    return (lin.lora_A["default"].weight, lin.lora_B["default"].weight,
            lin.lora_magnitude_vector["default"].weight)  # fmt: skip


def _ours(lin, x, backend, **kw):
    A, B, m = _adapter(lin)
    drop = lin.lora_dropout["default"]
    p = drop.p if isinstance(drop, nn.Dropout) else 0.0
    base = lin.base_layer
    return dora_linear(x, base.weight, base.bias, A, B, m, lin.scaling["default"], p,
                       backend=backend, **kw)  # fmt: skip


def _inputs(lead, d, k, dtype=torch.float32, device="cpu", seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=gen).to(device, dtype).requires_grad_(True)
    return x, torch.randn(*lead, k, generator=gen).to(device, dtype)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("r", [1, 8, 16, 64])
@pytest.mark.parametrize("bias, p", [(False, 0.0), (True, 0.25)])  # each on and off per rank
def test_dora_matches_stock_peft_fp32(backend, device, shape, r, bias, p):
    lead, d, k = shape
    if r == 64 and d > 200:
        d = 96  # rank 64 on a small width only (time budget)
    lin = _peft_dora(d, k, r, bias, p).to(device)
    x, g = _inputs(lead, d, k, device=device)
    leaves = [x, *_adapter(lin)]
    torch.manual_seed(11)
    if device == "cpu" or p == 0.0:
        want_y = lin(x)
    else:  # CUDA nn.Dropout draws with its own fused kernel: the oracle takes our draw
        noise = torch.empty(x.shape, device=device).bernoulli_(1 - p).div_(1 - p)
        base = lin.base_layer
        want_y = dora_linear_reference(x, base.weight, base.bias, *_adapter(lin),
                                       lin.scaling["default"], noise)  # fmt: skip
    want = torch.autograd.grad(want_y, leaves, g)
    torch.manual_seed(11)  # the same dropout draw (nn.Dropout's, on the adapter-dtype input)
    y = _ours(lin, x, backend)
    got = torch.autograd.grad(y, leaves, g)
    # fp32 against fp32 autograd: the same products in another association (h·(m/n) vs PEFT's
    # (m/n - 1)·base + ...), sums over <= 1023 terms: 1e-5 of each tensor's scale.
    assert_close(y, want_y, atol=1e-5 * want_y.abs().max().item(), rtol=1e-5, name="y")
    for name, a, e in zip(("dx", "dA", "dB", "dmagnitude"), got, want):
        assert_close(a, e, atol=1e-5 * e.abs().max().item(), rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("adapter", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dora_bf16_against_fp32_oracle(backend, device, adapter):
    d, k = 64, 48
    lin = _peft_dora(d, k, 8, True, 0.1, torch.bfloat16, adapter).to(device)
    x, g = _inputs((2, 9), d, k, torch.bfloat16, device)
    A, B, m = _adapter(lin)
    torch.manual_seed(4)
    y = _ours(lin, x, backend)
    got = torch.autograd.grad(y, [x, A, B, m], g)
    assert y.dtype == torch.bfloat16 and [t.dtype for t in got] == [x.dtype, adapter, adapter,
                                                                    adapter]  # fmt: skip
    torch.manual_seed(4)
    noise = torch.empty(x.shape, dtype=adapter, device=device).bernoulli_(0.9).float().div_(0.9)
    f = [t.detach().float().requires_grad_(True) for t in (x, A, B, m)]
    base = lin.base_layer
    ry = dora_linear_reference(f[0], base.weight.float(), base.bias.float(), f[1], f[2], f[3],
                               lin.scaling["default"], noise)  # fmt: skip
    want = torch.autograd.grad(ry, f, g.float())
    # bf16 products accumulate in fp32 and round once (2^-9 relative); h and y = (m/n)·h + b
    # round once more each, and the gradients see <= 3 such roundings (g·m/n, the rank-r
    # products, dx's sum): 2e-2 of each tensor's scale, as lora_linear's bf16 test.
    assert_close(y, ry, atol=2e-2 * ry.abs().max().item(), rtol=2e-2, name="y")
    for name, a, e in zip(("dx", "dA", "dB", "dmagnitude"), got, want):
        assert_close(a, e, atol=2e-2 * e.abs().max().item(), rtol=2e-2, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_dora_under_autocast_as_accurate_as_stock(backend, device):
    """fp32 layer under bf16 autocast: bf16 output like stock's; ours no farther from the fp32
    result than stock PEFT under the same autocast (rms, factor 1.5)."""
    from lorafuse.testing.numerics import assert_as_accurate_as_stock

    if device != "cpu":
        pytest.skip("CPU autocast case")
    lin = _peft_dora(96, 80, 8, True, 0.0)
    x, g = _inputs((4, 16), 96, 80)
    leaves = [x, *_adapter(lin)]
    exact = lin(x)
    oracle = torch.autograd.grad(exact, leaves, g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = lin(x)
        ours = _ours(lin, x, backend)
    assert ours.dtype == stock.dtype == torch.bfloat16
    assert_as_accurate_as_stock(ours.detach(), stock.detach(), exact.detach(), name="y")
    for name, a, s, e in zip(("dx", "dA", "dB", "dm"), torch.autograd.grad(ours, leaves, g),
                             torch.autograd.grad(stock, leaves, g), oracle):  # fmt: skip
        assert a.dtype == e.dtype
        assert_as_accurate_as_stock(a.bfloat16(), s.bfloat16(), e, name=name)


@pytest.mark.parametrize("tiles", [False, True], ids=["whole", "tiles"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_qdora_nf4_base_matches_dense_dequantized(monkeypatch, tiles, p):
    """QDoRA: an NF4 base equals DoRA on its dequantized dense weight (fp32 1e-5), whole or by
    tiles (TILE_BYTES lowered so a small weight is tiled), the norm from dequantized rows."""
    d, k = 256, 96
    lin = _peft_dora(d, k, 8, True, p)
    q = nf4.Linear4bit(lin.base_layer)
    qw = q.weight
    dense = qw.dequantize(torch.float32)
    if tiles:
        monkeypatch.setattr(weights, "TILE_BYTES", 16 << 10)
        monkeypatch.setattr(dora, "NORM_CHUNK_BYTES", 16 << 10)
        assert weights.tiled(qw, torch.float32)
    A, B, m = _adapter(lin)
    x, g = _inputs((3, 5), d, k)
    s = lin.scaling["default"]
    torch.manual_seed(2)
    y = dora_linear(x, qw, q.bias, A, B, m, s, p)
    got = torch.autograd.grad(y, [x, A, B, m], g)
    torch.manual_seed(2)
    ry = dora_linear(x, dense, q.bias, A, B, m, s, p, backend="torch")
    want = torch.autograd.grad(ry, [x, A, B, m], g)
    assert_close(y, ry, atol=1e-5 * ry.abs().max().item(), rtol=1e-5, name="y")
    for name, a, e in zip(("dx", "dA", "dB", "dm"), got, want):
        assert_close(a, e, atol=1e-5 * e.abs().max().item(), rtol=1e-5, name=name)


def _cancelling(k=32, d=1024, r=8, t=0.5, seed=0):
    """W with a large part in A's row space and B = -t·(that part's coordinates): s·B·A cancels
    the fraction t of it, κ about 9 at t = 0.5."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(r, d, generator=gen, dtype=torch.float64) / d**0.5
    C = torch.randn(k, r, generator=gen, dtype=torch.float64)
    W = 0.05 * torch.randn(k, d, generator=gen, dtype=torch.float64) / d**0.5 + 10 * C @ A
    coords = W @ A.t() @ torch.linalg.inv(A @ A.t())  # (k, r)
    return W.float(), A.float(), (-t * coords).float()


def test_weight_norm_accuracy_against_fp64(monkeypatch):
    W, A, B = _cancelling()
    exact = torch.linalg.norm(W.double() + B.double() @ A.double(), dim=1)

    def rel(n):
        return ((n.double() - exact).abs() / exact).max().item()

    materialised = rel(torch.linalg.norm(W + B @ A, dim=1))
    ours = rel(weight_norm(W, A, B, 1.0, torch.float32, "torch"))
    monkeypatch.setattr(dora, "KAPPA_MAX", float("inf"))  # the expanded sum on every row
    expanded = rel(weight_norm(W, A, B, 1.0, torch.float32, "torch"))
    # the rows past KAPPA_MAX are recomputed materialised: as accurate as the materialised norm
    # (both ~2e-7); the expanded sum alone cancels (~5e-7 here, and grows with κ)
    assert ours <= 1.01 * materialised, (ours, materialised)
    assert expanded > 2 * materialised, "the case does not cancel: the test checks nothing"


@pytest.mark.parametrize("backend, device", CASES)
def test_weight_norm_matches_fp64_without_cancellation(backend, device):
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(70, 300, generator=gen) / 300**0.5
    A = torch.randn(16, 300, generator=gen) / 300**0.5
    B = torch.randn(70, 16, generator=gen)
    exact = torch.linalg.norm(W.double() + 0.7 * B.double() @ A.double(), dim=1)
    got = weight_norm(W.to(device), A.to(device), B.to(device), 0.7, torch.float32, backend)
    assert got.dtype == torch.float32
    assert_close(got.cpu(), exact.float(), atol=0, rtol=1e-6, name="norm")


def test_dora_eval_mode_draws_nothing_and_magnitude_only_grad():
    lin = _peft_dora(16, 8, 2, False, 0.5)
    x, g = _inputs((3,), 16, 8)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    A, B, m = _adapter(lin)
    A.requires_grad_(False)
    B.requires_grad_(False)
    y = _ours(lin, x.detach(), "torch", training=False)
    assert torch.equal(state, torch.get_rng_state())
    lin.eval()
    assert_close(y, lin(x), atol=1e-6, rtol=1e-5, name="y")
    (dm,) = torch.autograd.grad(y, [m], g)
    assert dm.shape == m.shape


def test_dora_errors_name_the_problem():
    lin = _peft_dora(16, 8, 4, False, 0.0)
    A, B, m = _adapter(lin)
    w = lin.base_layer.weight
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"magnitude must be a floating \(8,\)"):
        dora_linear(x, w, None, A, B, m[:7])
    with pytest.raises(ValueError, match=r"lora_B must be \(8, 4\)"):
        dora_linear(x, w, None, A, B[:, :3], m)
    with pytest.raises(ValueError, match="requires grad"):
        dora_linear(x, w.clone().requires_grad_(True), None, A, B, m)


def _dora_tiny_llama(dropout=0.0):
    """A one-layer tiny Llama with DoRA on all seven projections, patched, random B."""
    from transformers import LlamaForCausalLM

    from lorafuse import patch_peft_model
    from lorafuse.testing import LORA_TARGETS, tiny_llama_config

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1))
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=LORA_TARGETS,
                          use_dora=True)  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return patch_peft_model(model).train()


@pytest.mark.slow  # a torch.compile trace of a whole (one-layer) model
def test_compiled_dora_has_no_graph_breaks_and_matches_eager():
    """Under torch.compile the DoRA norm, forward and backward are custom ops: no graph break
    (fullgraph=True fails on one), loss and every adapter gradient as eager (aot_eager draws the
    dropout masks with eager's RNG in the same order)."""
    import copy

    torch._dynamo.reset()
    eager = _dora_tiny_llama(dropout=0.1)
    compiled = copy.deepcopy(eager)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(3)
    loss_e = eager(input_ids=ids, labels=ids).loss
    loss_e.backward()
    torch.manual_seed(3)
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    try:
        loss_c = step(input_ids=ids, labels=ids).loss
        loss_c.backward()
    finally:
        torch._dynamo.reset()
    assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5, name="loss")
    grads = {n: p.grad for n, p in compiled.named_parameters() if p.requires_grad}
    assert sum("lora_magnitude_vector" in n for n in grads) == 7
    for name, p in eager.named_parameters():
        if p.requires_grad:
            assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_dora_custom_ops_opcheck(backend, device):
    """Schema, fake (shape/dtype) implementations and autograd registration of the three ops;
    the backward op skips the slow AOT dynamic-shape check, as tests/ops/test_custom_ops.py."""
    if device != "cpu":
        pytest.skip("CPU case")
    lin = _peft_dora(24, 16, 4, True, 0.0)
    A, B, m = (t.detach().requires_grad_(True) for t in _adapter(lin))
    w, b = lin.base_layer.weight.detach(), lin.base_layer.bias.detach()
    x = torch.randn(5, 24, requires_grad=True)
    mask = torch.rand(5, 24) > 0.25
    norm = dora.dora_weight_norm_op(w, A.detach(), B.detach(), 2.0, backend)
    scale = (m.detach() / norm).requires_grad_(True)
    y, xa, h = dora.dora_linear_op(x, w, b, A, B, scale, 2.0, mask, 0.75, backend)
    g = torch.randn_like(y)
    cases = [
        (dora.dora_weight_norm_op, (w, A.detach(), B.detach(), 2.0, backend), True),
        (dora.dora_linear_op, (x, w, b, A, B, scale, 2.0, mask, 0.75, backend), True),
        (dora.dora_linear_backward_op, (g, x.detach(), w, A.detach(), B.detach(),
         xa.detach(), mask, h.detach(), scale.detach(), 2.0, 0.75, [True] * 5, backend), False),
    ]  # fmt: skip
    for op, args, aot in cases:
        utils = ("test_schema", "test_autograd_registration", "test_faketensor")
        torch.library.opcheck(
            op, args, test_utils=utils + (("test_aot_dispatch_dynamic",) if aot else ())
        )
