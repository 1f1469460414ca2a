"""The chunked student/teacher divergence against TRL's whole-logits ``generalized_jsd_loss`` (its
GKD trainer's, per token) and our reference: values, entropy and the student hidden's gradient."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops.divergence import divergence, divergence_reference
from lorafuse.testing import assert_close

# (N tokens, Hs, Ht, V): a lone token, a teacher wider than the student, several chunks of 7
SHAPES = [(1, 33, 33, 37), (41, 24, 40, 129)]
BETAS = [0.0, 1.0, 0.5, 0.2]


def _inputs(N, Hs, Ht, V, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, Hs, generator=gen)
    ws = torch.randn(V, Hs, generator=gen) * 2 / Hs**0.5
    ht = torch.randn(N, Ht, generator=gen)
    wt = torch.randn(V, Ht, generator=gen) * 2 / Ht**0.5
    bs = 0.5 * torch.randn(V, generator=gen) if bias else None
    bt = 0.5 * torch.randn(V, generator=gen) if bias else None
    return hs, ws, bs, ht, wt, bt


def _trl_per_token(hs, ws, bs, ht, wt, bt, beta, temperature):
    from trl.experimental.gkd import GKDTrainer

    zs = torch.nn.functional.linear(hs, ws, bs)[None]  # (1, N, V)
    zt = torch.nn.functional.linear(ht, wt, bt)[None]
    per = GKDTrainer.generalized_jsd_loss(zs, zt, beta=beta, temperature=temperature,
                                          reduction="none")  # fmt: skip
    return per.sum(-1)[0]  # (N,)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature, bias", [(1.0, False), (0.7, True)])
def test_divergence_equals_trl_and_reference(shape, beta, temperature, bias):
    hs, ws, bs, ht, wt, bt = _inputs(*shape, bias)
    upstream = torch.rand(shape[0], generator=torch.Generator().manual_seed(1)) + 0.5
    grads, values = [], []
    for fn in (
        lambda h: divergence(h, ws, ht, wt, beta, temperature, bs, bt, chunk_size=7)[0],
        lambda h: divergence_reference(h, ws, ht, wt, beta, temperature, bs, bt)[0],
        lambda h: _trl_per_token(h, ws, bs, ht, wt, bt, beta, temperature),
    ):
        h = hs.clone().requires_grad_(True)
        out = fn(h)
        (dh,) = torch.autograd.grad((out * upstream).sum(), [h])
        values.append(out.detach())
        grads.append(dh)
    assert values[2].abs().max() > 1e-2  # a real divergence, not two equal distributions
    for name, i in (("reference", 1), ("trl", 2)):
        assert_close(values[0], values[i], atol=1e-5, rtol=1e-5, name=f"divergence vs {name}")
        assert_close(grads[0], grads[i], atol=1e-5, rtol=1e-5, name=f"d hidden vs {name}")


def test_entropy_and_no_grad_path():
    hs, ws, bs, ht, wt, bt = _inputs(13, 16, 16, 50, False)
    with torch.no_grad():
        div, ent = divergence(hs, ws, ht, wt, 0.5, chunk_size=4)
        ref_div, ref_ent = divergence_reference(hs, ws, ht, wt, 0.5)
    assert_close(div, ref_div, atol=1e-6, rtol=1e-5, name="divergence")
    assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5, name="entropy")


def test_checks():
    hs, ws, _, ht, wt, _ = _inputs(3, 8, 8, 11, False)
    with pytest.raises(ValueError, match="vocabulary"):
        divergence(hs, ws, ht, wt[:10], 0.5)
    with pytest.raises(ValueError, match="beta"):
        divergence(hs, ws, ht, wt, 1.5)
    with pytest.raises(ValueError, match="requires grad"):
        divergence(hs, ws.requires_grad_(True), ht, wt, 0.5)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
def test_bf16_no_worse_than_trl(beta):
    """bf16 operands against an fp64 oracle on the same bf16 values: our divergence and hidden
    gradient are no further from it than TRL's DistillationTrainer kernel (its CPU path)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    hs, ws, _, ht, wt, _ = (None if t is None else t.bfloat16()
                            for t in _inputs(37, 64, 48, 1000, False, seed=3))  # fmt: skip
    upstream = torch.rand(37, generator=torch.Generator().manual_seed(1)) + 0.5
    out = {}
    for name, fn in (
        (
            "oracle",
            lambda h: divergence_reference(h.double(), ws.double(), ht.double(), wt.double(), beta)[
                0
            ],
        ),  # fmt: skip
        ("ours", lambda h: divergence(h, ws, ht, wt, beta, chunk_size=8)[0]),
        (
            "trl",
            lambda h: ChunkedDivergenceFunction.apply(
                h, ws, None, ht, wt, None, beta, 1.0, 1.0, None, 1.0, None
            )[0],
        ),  # fmt: skip
    ):
        h = hs.clone().requires_grad_(True)
        value = fn(h)
        (dh,) = torch.autograd.grad((value * upstream).sum(), [h])
        out[name] = (value.detach().double(), dh.double())
    for i, what in ((0, "divergence"), (1, "d hidden")):
        ref = out["oracle"][i]
        err = {k: (out[k][i] - ref).abs() for k in ("ours", "trl")}
        assert err["ours"].max() <= err["trl"].max() * 1.0001 + 1e-9, (what, err)
        assert err["ours"].mean() <= err["trl"].mean() * 1.0001 + 1e-9, (what, err)
