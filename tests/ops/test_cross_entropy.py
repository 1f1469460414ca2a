"""fused_linear_cross_entropy against F.cross_entropy / HF ForCausalLMLoss, every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops import cross_entropy as ce
from lorafuse.ops import cross_entropy_chunks as chunks
from lorafuse.ops.cross_entropy import fused_linear_cross_entropy, linear_cross_entropy_reference
from lorafuse.testing import assert_close, op_cases

CASES = op_cases("cross_entropy")
# (N tokens, H, V): one token of width 1023, and 3x37 tokens of width 129 over an odd vocabulary.
SHAPES = [(1, 1023, 37), (111, 129, 257)]


def _inputs(N, H, V, dtype, bias=False, seed=0, ignore_frac=0.3, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 2 / H**0.5).to(dtype)
    b = (0.5 * torch.randn(V, generator=gen)).to(dtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    drop = torch.rand(N, generator=gen) < ignore_frac
    drop[0] = False  # keep at least one real target
    targets[drop] = -100
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(hidden), to(weight), to(b), to(targets)


def _loss_and_grads(fn, hidden, weight, bias, train_weight):
    leaves = [hidden.detach().clone().requires_grad_(True)]
    weight = weight.detach().clone().requires_grad_(train_weight)
    if train_weight:
        leaves.append(weight)
    if bias is not None:
        bias = bias.detach().clone().requires_grad_(True)
        leaves.append(bias)
    loss = fn(leaves[0], weight, bias)
    return loss, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("norm", ["mean", "sum", "num_items"])
def test_flce_fp32(backend, device, shape, bias, norm):
    chunk_size = 7  # several chunks and a ragged last one; the automatic size is tested below
    hidden, weight, b, targets = _inputs(*shape, torch.float32, bias, device=device)
    red = "sum" if norm == "sum" else "mean"
    items = 50 if norm == "num_items" else None
    loss, grads = _loss_and_grads(
        lambda h, w, bb: fused_linear_cross_entropy(
            h, w, targets, bb, reduction=red, num_items_in_batch=items, chunk_size=chunk_size,
            backend=backend),
        hidden, weight, b, train_weight=True,
    )  # fmt: skip
    rloss, rgrads = _loss_and_grads(
        lambda h, w, bb: linear_cross_entropy_reference(
            h, w, targets, bb, reduction=red, num_items_in_batch=items),
        hidden, weight, b, train_weight=True,
    )  # fmt: skip
    assert loss.dtype == torch.float32 and loss.dim() == 0
    # fp32 throughout; logsumexp and the H-long dot products differ only in summation order.
    assert_close(loss, rloss, atol=1e-5, rtol=1e-5, name="loss")
    for name, a, r in zip(("dhidden", "dweight", "dbias"), grads, rgrads):
        assert_close(a, r, atol=1e-5 * r.abs().max().item(), rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_flce_bf16_against_fp32_oracle(backend, device):
    hidden, weight, b, targets = _inputs(23, 48, 97, torch.bfloat16, bias=True, device=device)
    loss, grads = _loss_and_grads(
        lambda h, w, bb: fused_linear_cross_entropy(h, w, targets, bb, chunk_size=5, backend=backend),
        hidden, weight, b, train_weight=True,
    )  # fmt: skip
    rloss, rgrads = _loss_and_grads(
        lambda h, w, bb: linear_cross_entropy_reference(h, w, targets, bb),
        hidden.float(), weight.float(), b.float(), train_weight=True,
    )  # fmt: skip
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    # The loss is fp32 over fp32 logits of exact bf16 inputs (on AVX2 CPUs the product runs in
    # fp32; with native bf16 products, CUDA or AMX, the logits are a bf16 product, ~2^-9
    # relative): 4e-3 relative covers both.
    assert_close(loss, rloss, atol=1e-4, rtol=4e-3, name="loss")
    # Gradients: fp32 (softmax - onehot), one bf16 GEMM rounding of 2^-9 per output (plus the
    # bf16 rounding of the gradient itself where the product is bf16): 2e-2 of the tensor's scale
    # bounds it.
    for name, a, r in zip(("dhidden", "dweight", "dbias"), grads, rgrads):
        assert_close(a, r, atol=2e-2 * r.abs().max().item(), rtol=2e-2, name=name)


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_flce_softcap_fp32(backend, device, bias):
    """Gemma 2's final-logit soft-capping: softcap 3 on logits of std ~2 saturates tanh, so a
    missing or wrong 1 - tanh² factor moves every gradient."""
    hidden, weight, b, targets = _inputs(111, 129, 257, torch.float32, bias, device=device)
    loss, grads = _loss_and_grads(
        lambda h, w, bb: fused_linear_cross_entropy(h, w, targets, bb, chunk_size=7,
                                                    backend=backend, softcap=3.0),
        hidden, weight, b, train_weight=True,
    )  # fmt: skip
    rloss, rgrads = _loss_and_grads(
        lambda h, w, bb: linear_cross_entropy_reference(h, w, targets, bb, softcap=3.0),
        hidden, weight, b, train_weight=True,
    )  # fmt: skip
    plain, _ = _loss_and_grads(
        lambda h, w, bb: linear_cross_entropy_reference(h, w, targets, bb),
        hidden, weight, b, train_weight=True,
    )  # fmt: skip
    assert abs(plain.item() - rloss.item()) > 0.1  # the capping matters here
    # fp32 throughout: tanh, logsumexp and the dot products differ only in summation order
    assert_close(loss, rloss, atol=1e-5, rtol=1e-5, name="loss")
    for name, a, r in zip(("dhidden", "dweight", "dbias"), grads, rgrads):
        assert_close(a, r, atol=1e-5 * r.abs().max().item(), rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_flce_softcap_bf16_is_as_accurate_as_stock_bf16(backend, device):
    """bf16 soft-capped loss against the fp32 oracle on the same (bf16-exact) inputs: no worse
    than stock's bf16 (HF's three bf16 ops on bf16 logits, autograd's bf16 backward)."""
    hidden, weight, b, targets = _inputs(23, 48, 97, torch.bfloat16, bias=True, device=device)

    def run(fn, dtype):
        return _loss_and_grads(fn, hidden.to(dtype), weight.to(dtype), b.to(dtype), True)

    got = run(lambda h, w, bb: fused_linear_cross_entropy(h, w, targets, bb, chunk_size=5,
                                                          backend=backend, softcap=2.0),
              torch.bfloat16)  # fmt: skip
    ref = lambda h, w, bb: linear_cross_entropy_reference(h, w, targets, bb, softcap=2.0)  # noqa: E731
    stock, oracle = run(ref, torch.bfloat16), run(ref, torch.float32)

    def err(out):
        loss, grads = out
        rel = [((g.float() - o).norm() / o.norm()).item() for g, o in zip(grads, oracle[1])]
        return abs(loss.item() - oracle[0].item()), max(rel)

    (le, ge), (ls, gs) = err(got), err(stock)
    # bf16 eps 7.8e-3: the two place their roundings differently (the fused loss keeps logits
    # in fp32 where the product is fp32), so allow twice stock's error plus one rounding's worth
    assert le <= 2 * ls + 2e-3, (le, ls)
    assert ge <= 2 * gs + 2e-3, (ge, gs)


def test_flce_softcap_must_be_positive():
    hidden, weight, _, targets = _inputs(4, 8, 11, torch.float32)
    with pytest.raises(ValueError, match="softcap must be > 0, got 0.0"):
        fused_linear_cross_entropy(hidden, weight, targets, softcap=0.0)


@pytest.mark.parametrize("items", [None, 7, torch.tensor(7)])
def test_flce_matches_hf_for_causal_lm_loss(items):
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, _, labels = _inputs(2 * 9, 32, 61, torch.float32, seed=5)
    labels = labels.view(2, 9)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]  # the caller's job
    h = hidden.view(2, 9, 32).requires_grad_(True)
    want = ForCausalLMLoss(h @ weight.t(), labels, 61, num_items_in_batch=items)
    (rgrad,) = torch.autograd.grad(want, h)
    got = fused_linear_cross_entropy(h, weight, shifted, num_items_in_batch=items)
    (grad,) = torch.autograd.grad(got, h)
    assert_close(got, want, atol=1e-6, rtol=1e-6, name="loss")
    assert_close(grad, rgrad, atol=1e-7, rtol=1e-5, name="dhidden")


@pytest.mark.parametrize("reduction, items", [("mean", None), ("sum", None), ("mean", 12)])
def test_flce_all_ignored_gives_zero_loss_and_zero_grads(reduction, items):
    hidden, weight, _, targets = _inputs(6, 16, 11, torch.float32)
    targets[:] = -100
    loss, grads = _loss_and_grads(
        lambda h, w, bb: fused_linear_cross_entropy(h, w, targets, reduction=reduction,
                                                    num_items_in_batch=items),
        hidden, weight, None, train_weight=True,
    )  # fmt: skip
    assert loss.item() == 0.0
    assert all(bool((g == 0).all()) for g in grads)


def test_flce_projects_only_rows_with_a_target(monkeypatch):
    """Ignored rows never reach the (rows, V) GEMMs; their gradient is exactly zero."""
    hidden, weight, _, targets = _inputs(40, 16, 11, torch.float32, ignore_frac=0.5)
    seen = []
    kernel = chunks.torch_chunk_forward_backward

    def counting_kernel(logits, *args):
        seen.append(logits.shape[0])
        return kernel(logits, *args)

    monkeypatch.setattr(chunks, "implementation", lambda backend: counting_kernel)
    h = hidden.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(h, weight, targets, chunk_size=7, backend="torch")
    (grad,) = torch.autograd.grad(loss, h)
    valid = targets != -100
    assert sum(seen) == int(valid.sum()) < 40
    want, (want_grad,) = _loss_and_grads(
        lambda hh, w, bb: linear_cross_entropy_reference(hh, w, targets), hidden, weight, None,
        train_weight=False,
    )  # fmt: skip
    assert_close(loss, want, atol=1e-6, rtol=1e-6, name="loss")
    assert_close(grad, want_grad, atol=1e-7, rtol=1e-5, name="dhidden")
    assert bool((grad[~valid] == 0).all())


def test_flce_num_items_normalises_the_sum():
    hidden, weight, _, targets = _inputs(20, 16, 11, torch.float32)
    total = fused_linear_cross_entropy(hidden, weight, targets, reduction="sum")
    per_item = fused_linear_cross_entropy(hidden, weight, targets, num_items_in_batch=40)
    mean = fused_linear_cross_entropy(hidden, weight, targets)
    n_valid = int((targets != -100).sum())
    assert_close(per_item, total / 40, atol=0, rtol=1e-6, name="sum/num_items")
    assert_close(mean, total / n_valid, atol=0, rtol=1e-6, name="sum/n_valid")


def test_flce_frozen_weight_gets_no_grad_and_no_grad_mode_computes_loss_only():
    hidden, weight, _, targets = _inputs(9, 16, 11, torch.float32)
    h = hidden.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(h, weight, targets)
    loss.backward()
    assert weight.grad is None and h.grad is not None
    with torch.no_grad():
        again = fused_linear_cross_entropy(h, weight, targets)
    assert not again.requires_grad and again.item() == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize("backend, device", CASES)
def test_chunk_kernel_contract(backend, device):
    """The chunk kernel directly: per-row loss, logits overwritten with grad_scale·(softmax-onehot)."""
    kernel = chunks.implementation(backend)
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 70, generator=gen) * 4).to(device)
    targets = torch.randint(0, 70, (9,), generator=gen).to(device)
    targets[[2, 5]] = -1
    want_loss = torch.nn.functional.cross_entropy(logits, targets.clamp(min=0), reduction="none")
    want_grad = (logits.softmax(-1) - torch.nn.functional.one_hot(targets.clamp(min=0), 70)) * 0.25
    want_loss[[2, 5]] = 0
    want_grad[[2, 5]] = 0
    work = logits.clone()
    loss = kernel(work, targets, -1, 0.25)
    assert_close(loss, want_loss, atol=1e-5, rtol=1e-5, name="loss")
    assert_close(work, want_grad, atol=1e-6, rtol=1e-5, name="grad")
    with pytest.raises((ValueError, RuntimeError), match="70"):
        kernel(logits.clone(), torch.full((9,), 70, device=device), -100, 1.0)


def test_flce_auto_chunk_bounds_fp32_logits():
    assert ce.chunk_rows(10_000, 49152, None) * 49152 * 4 <= ce.CHUNK_BYTES
    assert ce.chunk_rows(3, 49152, None) == 3
    assert ce.chunk_rows(10, 50, 4) == 4


def test_flce_errors_name_the_problem():
    hidden, weight, _, targets = _inputs(5, 16, 11, torch.float32)
    with pytest.raises(ValueError, match=r"outside \[0, 11\).*e\.g\. 11"):
        fused_linear_cross_entropy(hidden, weight, torch.full((5,), 11))
    with pytest.raises(ValueError, match=r"weight must be \(V, 16\)"):
        fused_linear_cross_entropy(hidden, weight[:, :15], targets)
    with pytest.raises(ValueError, match=r"targets must be \(5,\)"):
        fused_linear_cross_entropy(hidden, weight, targets[:4])
    with pytest.raises(ValueError, match="weight dtype torch.float64"):
        fused_linear_cross_entropy(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="int64"):
        fused_linear_cross_entropy(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(NotImplementedError, match="LoRA on lm_head"):
        fused_linear_cross_entropy(hidden, weight, targets, lora_A=torch.zeros(2, 16),
                                   lora_B=torch.zeros(11, 2), scaling=1.0)  # fmt: skip


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowp_chunk_kernel_is_the_fp32_kernel_on_upcast_logits_rounded_once(backend, device, dtype):
    """The low-precision chunk kernel: per-row loss of ``logits.float()``, and the logits
    overwritten with the fp32 kernel's gradient rounded to their dtype once (no fp32 (n, V))."""
    kernel = chunks.lowp_implementation(backend)
    gen = torch.Generator().manual_seed(2)
    V = 1000 + 3  # a ragged tail past every vector width
    logits = (torch.randn(6, V, generator=gen) * 4).to(dtype).to(device)
    targets = torch.randint(0, V, (6,), generator=gen).to(device)
    targets[[1, 4]] = -100
    upcast = logits.float()
    want_loss = chunks.torch_chunk_forward_backward(upcast, targets, -100, 0.25)
    want = upcast.to(dtype)  # the fp32 gradient, rounded once
    work = logits.clone()
    loss = kernel(work, targets, -100, 0.25)
    assert work.dtype == dtype and loss.dtype == torch.float32
    # fp32 throughout; the log-sum-exp differs only in summation order and exp's last bit.
    assert_close(loss, want_loss, atol=1e-5, rtol=1e-5, name="loss")
    # The fp32 gradients agree to ~1e-7 relative, so their roundings agree or differ by one ulp:
    # adjacent values of one sign are adjacent integers in the 16-bit pattern.
    steps = (work.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1 and float((steps == 0).float().mean()) > 0.99
    assert bool((work[[1, 4]] == 0).all()) and bool((loss[[1, 4]] == 0).all())
    before = logits.clone()
    with pytest.raises((ValueError, RuntimeError), match=str(V)):
        kernel(logits, torch.full((6,), V, device=device), -100, 1.0)
    assert torch.equal(logits, before)  # a bad target leaves the logits untouched


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_flce_native_bf16_is_hf_bf16(monkeypatch, bias, chunk_size):
    """Where bf16 products are native, the op is HF's bf16 path: logits = F.linear in bf16 (bias
    added as addmm adds it), ``.float()``, the gradient rounded to bf16 once, dx a bf16 GEMM."""
    monkeypatch.setenv("LORAFUSE_CPU_LOW_PRECISION", "native")
    hidden, weight, b, targets = _inputs(23, 48, 97, torch.bfloat16, bias=bias, seed=3)
    got, grads = _loss_and_grads(
        lambda h, w, bb: fused_linear_cross_entropy(h, w, targets, bb, chunk_size=chunk_size),
        hidden, weight, b, train_weight=False,
    )  # fmt: skip
    want, rgrads = _loss_and_grads(
        lambda h, w, bb: linear_cross_entropy_reference(h, w, targets, bb),
        hidden, weight, b, train_weight=False,
    )  # fmt: skip
    # The same bf16 logits, summed in fp32 in another order.
    assert_close(got, want, atol=1e-6, rtol=1e-5, name="loss")
    # dhidden: bf16 GEMMs of the same bf16 gradient; only the GEMM's blocking over the token rows
    # may differ (one bf16 rounding, 2^-8 relative). dbias: that gradient summed in fp32 per
    # chunk vs in bf16 by autograd, again one rounding.
    for name, a, r in zip(("dhidden", "dbias"), grads, rgrads):
        assert a.dtype == torch.bfloat16
        assert_close(a, r, atol=2**-8 * r.abs().max().item(), rtol=2**-8, name=name)


def _recording(monkeypatch):
    """Replace both chunk kernels by the torch ones, recording (dtype, storage, rows) per chunk.

    ``seen`` keeps every chunk's logits alive, so per-chunk tensors could not share an address."""
    seen = []

    def wrap(kernel):
        def run(logits, *args):
            seen.append((logits.dtype, logits, logits.shape[0]))
            return kernel(logits, *args)

        return lambda backend: run

    monkeypatch.setattr(chunks, "implementation", wrap(chunks.torch_chunk_forward_backward))
    monkeypatch.setattr(
        chunks, "lowp_implementation", wrap(chunks.torch_chunk_forward_backward_lowp)
    )
    return seen


@pytest.mark.parametrize(
    "dtype, branch, scratch",
    [
        (torch.bfloat16, "native", torch.bfloat16),  # the bf16 GEMM's output, no fp32 (n, V)
        (torch.bfloat16, "emulated", torch.float32),  # AVX2: fp32 products, fp32 gradient
        (torch.float32, "native", torch.float32),
    ],
)
def test_flce_one_scratch_of_the_gemm_dtype_serves_every_chunk(monkeypatch, dtype, branch, scratch):
    monkeypatch.setenv("LORAFUSE_CPU_LOW_PRECISION", branch)
    seen = _recording(monkeypatch)
    hidden, weight, _, targets = _inputs(40, 16, 11, dtype, ignore_frac=0.0)
    h = hidden.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(h, weight, targets, chunk_size=7, backend="torch")
    (grad,) = torch.autograd.grad(loss, h)
    assert [rows for *_, rows in seen] == [7] * 5 + [5]  # the last chunk: a prefix of the scratch
    assert {d for d, *_ in seen} == {scratch}
    assert len({t.untyped_storage().data_ptr() for _, t, _ in seen}) == 1  # one scratch
    want, (want_grad,) = _loss_and_grads(
        lambda hh, w, bb: linear_cross_entropy_reference(hh, w, targets), hidden.float(),
        weight.float(), None, train_weight=False,
    )  # fmt: skip
    # Against the fp32 oracle: bf16 logits (2^-9 relative) and a bf16-rounded gradient on the
    # native branch; fp32 elsewhere. The bound of test_flce_bf16_against_fp32_oracle.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(loss, want, atol=tol, rtol=tol, name="loss")
    assert_close(grad, want_grad, atol=tol * want_grad.abs().max().item(), rtol=tol, name="dh")


def test_flce_auto_chunks_are_balanced():
    V = 49152
    most = ce.CHUNK_BYTES // (4 * V)  # 682 rows of fp32 logits
    assert ce.chunk_rows(most, V, None) == most
    # One row more would leave a 1-row chunk streaming the whole weight twice: split evenly.
    assert ce.chunk_rows(most + 1, V, None) == (most + 2) // 2
    assert ce.chunk_rows(2050, V, None) == 513  # 4 x 513 (or 512), not 3 x 682 + 4
    for n in (1, 2044, 5000, 10_001):
        rows = ce.chunk_rows(n, V, None)
        chunks = -(-n // rows)
        assert rows <= most and chunks * rows - n < chunks  # under one idle row per chunk


def test_flce_low_precision_scratch_takes_more_rows_only_where_few_fit():
    """A bf16 scratch (2 bytes a logit) holds twice the fp32 rule's rows where that rule leaves
    fewer than WIDE_ROWS (a large vocabulary: Qwen3.5's 248320), never more than the budget."""
    V = 248320
    assert ce.chunk_rows(255, V, None) == 128  # fp32: 135 rows fit, two balanced chunks
    assert ce.chunk_rows(255, V, None, scratch_bytes=2) == 255  # one chunk, 121 MiB of bf16
    for n in (255, 1000, 4096):
        assert ce.chunk_rows(n, V, None, scratch_bytes=2) * V * 2 <= ce.CHUNK_BYTES
    # 682 fp32 rows of SmolLM2's 49152 already amortise the weight's reads: unchanged
    assert ce.chunk_rows(5000, 49152, None, scratch_bytes=2) == ce.chunk_rows(5000, 49152, None)
