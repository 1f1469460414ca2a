"""token_logprobs against log_softmax(...).gather(...) summed per sequence, every backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorafuse.ops.token_logprobs import token_logprobs, token_logprobs_reference
from lorafuse.testing import assert_close, op_cases

CASES = op_cases("cross_entropy")  # the op runs the fused cross-entropy's chunk kernel
# (N tokens, H, V, S sequences): one token of width 1023; 111 tokens of width 129 in 5 sequences
SHAPES = [(1, 1023, 37, 1), (111, 129, 257, 5)]


def _inputs(N, H, V, S, dtype, bias=False, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 2 / H**0.5).to(dtype)
    b = (0.5 * torch.randn(V, generator=gen)).to(dtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    drop = torch.rand(N, generator=gen) < 0.3
    drop[0] = False
    targets[drop] = -100
    seq_ids = torch.randint(0, S, (N,), generator=gen)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(hidden), to(weight), to(b), to(targets), to(seq_ids)


def _run(fn, hidden, upstream):
    h = hidden.detach().clone().requires_grad_(True)
    out = fn(h)
    (dh,) = torch.autograd.grad((out * upstream).sum(), [h])
    return out.detach(), dh


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_reference(backend, device, shape, bias):
    hidden, weight, b, targets, seq = _inputs(*shape, torch.float32, bias, device=device)
    S = shape[3]
    # a different incoming gradient per sequence: backward must scale each row by its own
    upstream = torch.linspace(-2.0, 3.0, S, device=device)
    out, dh = _run(lambda h: token_logprobs(h, weight, targets, seq, S, bias=b, chunk_size=7,
                                            backend=backend), hidden, upstream)  # fmt: skip
    ref, rdh = _run(
        lambda h: token_logprobs_reference(h, weight, targets, seq, S, bias=b), hidden, upstream
    )
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name="logps")
    assert_close(dh, rdh, atol=1e-5, rtol=1e-5, name="d hidden")


def test_matches_log_softmax_gather_batched():
    """The (S, T, H) form: one sequence per row, as HF's log_softmax(...).gather(...).sum(-1)."""
    S, T, H, V = 3, 11, 16, 50
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(S, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / 4
    targets = torch.randint(0, V, (S, T), generator=gen)
    targets[:, :4] = -100  # a prompt
    h = hidden.clone().requires_grad_(True)
    out = token_logprobs(h, weight, targets)
    out.sum().backward()
    h2 = hidden.clone().requires_grad_(True)
    lp = F.linear(h2, weight).log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ref = (lp * (targets != -100)).sum(-1)
    ref.sum().backward()
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name="logps")
    assert_close(h.grad, h2.grad, atol=1e-5, rtol=1e-5, name="d hidden")
    assert float(h.grad[:, :4].abs().max()) == 0.0  # prompt rows get no gradient


@pytest.mark.parametrize("backend, device", CASES)
def test_bf16_against_fp32_oracle(backend, device):
    hidden, weight, _, targets, seq = _inputs(111, 129, 257, 5, torch.bfloat16, device=device)
    upstream = torch.linspace(-1.0, 1.0, 5, device=device)
    out, dh = _run(lambda h: token_logprobs(h, weight, targets, seq, 5, chunk_size=16,
                                            backend=backend), hidden, upstream)  # fmt: skip
    oracle, odh = _run(
        lambda h: token_logprobs_reference(h, weight.float(), targets, seq, 5),
        hidden.float(),
        upstream,
    )
    # Same bf16 operands. Where bf16 products are native (CUDA, AVX-512-BF16 CPUs) each logit is
    # a bf16 product, ~2^-9 relative, as HF's bf16 lm_head; elsewhere it is fp32. The errors of
    # the ~20 summed tokens partly cancel: 4e-3 relative (the fused cross-entropy's bound) covers it.
    assert_close(out, oracle, atol=1e-4, rtol=4e-3, name="bf16 logps")
    assert_close(dh.float(), odh, atol=1e-2, rtol=8e-3, name="bf16 d hidden")


def test_all_targets_ignored_gives_zero():
    hidden, weight, _, _, seq = _inputs(9, 8, 11, 2, torch.float32)
    targets = torch.full((9,), -100)
    h = hidden.clone().requires_grad_(True)
    out = token_logprobs(h, weight, targets, seq, 2)
    out.sum().backward()
    assert out.tolist() == [0.0, 0.0]
    assert float(h.grad.abs().max()) == 0.0


def test_errors_name_the_problem():
    hidden, weight, _, targets, seq = _inputs(9, 8, 11, 2, torch.float32)
    with pytest.raises(ValueError, match="requires grad"):
        token_logprobs(hidden, weight.clone().requires_grad_(True), targets, seq, 2)
    with pytest.raises(ValueError, match=r"weight must be \(V, 8\)"):
        token_logprobs(hidden, weight.t(), targets, seq, 2)
    with pytest.raises(ValueError, match="outside"):
        token_logprobs(hidden, weight, torch.full((9,), 11), seq, 2)
    with pytest.raises(ValueError, match=r"\(S, T, H\)"):
        token_logprobs(hidden, weight, targets)
