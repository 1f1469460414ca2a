"""apply_rope against HF's apply_rotary_pos_emb (the reference), every backend."""

from __future__ import annotations

import pytest
import torch

from lorafuse.ops.rope import apply_rope, rope_reference
from lorafuse.testing import assert_close, op_cases, tiny_llama_config

CASES = op_cases("rope")
# (B, Hq, Hk, T, D): one position of a wide head; GQA with an odd half-dim (65) and odd T.
SHAPES = [(1, 1, 1, 1, 1022), (3, 4, 2, 37, 130)]


def _tables(B, T, D, gen, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))  # (D/2,)
    pos = torch.randint(0, 500, (B, T), generator=gen).float()
    freqs = pos[..., None] * inv  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D), HF layout
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _inputs(shape, dtype, cos_batch, seed=0, device="cpu"):
    B, Hq, Hk, T, D = shape
    gen = torch.Generator().manual_seed(seed)
    # HF hands q/k over as transposed views of the (B, T, H, D) projections: keep that layout.
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(B, T, Hk, D, generator=gen).to(dtype).transpose(1, 2)
    cos, sin = _tables(B if cos_batch == "B" else 1, T, D, gen, dtype)
    gq = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    gk = torch.randn(B, Hk, T, D, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (q, k, cos, sin, gq, gk))


def _run(fn, q, k, cos, sin, gq, gk):
    q = q.detach().clone().requires_grad_(True)  # clone keeps the transposed strides
    k = k.detach().clone().requires_grad_(True)
    qo, ko = fn(q, k, cos, sin)
    torch.autograd.backward([qo, ko], [gq, gk])
    return qo, ko, q.grad, k.grad


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cos_batch", ["B", "1"])
def test_rope_fp32(backend, device, shape, cos_batch):
    q, k, cos, sin, gq, gk = _inputs(shape, torch.float32, cos_batch, device=device)
    got = _run(lambda *a: apply_rope(*a, backend=backend), q, k, cos, sin, gq, gk)
    want = _run(rope_reference, q, k, cos, sin, gq, gk)
    # Two products and a sum per element in fp32: a few ulps at most (FMA vs separate ops).
    for name, a, b in zip(("q", "k", "dq", "dk"), got, want):
        assert_close(a, b, atol=1e-6, rtol=1e-5, name=name)


@pytest.mark.parametrize("backend, device", CASES)
def test_rope_bf16_against_fp32_oracle(backend, device):
    q, k, cos, sin, gq, gk = _inputs(SHAPES[1], torch.bfloat16, "B", device=device)
    got = _run(lambda *a: apply_rope(*a, backend=backend), q, k, cos, sin, gq, gk)
    f = [t.float() for t in (q, k, cos, sin, gq, gk)]
    want = _run(rope_reference, *f)
    assert all(t.dtype == torch.bfloat16 for t in got)
    # fp32 math on exact bf16 inputs, one rounding to bf16 (2^-9 relative); the sum of two
    # products can cancel, so the absolute floor is 2^-9 of the inputs' O(1) scale.
    for name, a, b in zip(("q", "k", "dq", "dk"), got, want):
        assert_close(a, b, atol=4e-3, rtol=8e-3, name=name)


def test_rope_matches_transformers_with_hf_rotary_tables():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = tiny_llama_config()
    rotary = LlamaRotaryEmbedding(cfg)
    B, T, D = 2, 11, cfg.hidden_size // cfg.num_attention_heads
    x = torch.randn(B, T, cfg.hidden_size)
    cos, sin = rotary(x, torch.arange(T)[None].expand(B, T))
    q = torch.randn(B, T, cfg.num_attention_heads, D).transpose(1, 2)
    k = torch.randn(B, T, cfg.num_key_value_heads, D).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = apply_rope(q, k, cos, sin, backend="torch")
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # same fp32 ops: bit-exact
    for backend, device in (c.values for c in CASES):
        if device != "cpu":
            continue
        got_q, got_k = apply_rope(q, k, cos, sin, backend=backend)
        assert_close(got_q, want_q, atol=1e-6, rtol=1e-5, name=f"{backend} q")
        assert_close(got_k, want_k, atol=1e-6, rtol=1e-5, name=f"{backend} k")


def test_rope_backward_is_inverse_rotation():
    """With cos²+sin²=1 the backward map is the inverse: rotating then back gives the input."""
    q, k, cos, sin, _, _ = _inputs(SHAPES[1], torch.float32, "1")
    from lorafuse.ops.rope import _torch_backward, _torch_forward

    back_q, back_k = _torch_backward(*_torch_forward(q, k, cos, sin), cos, sin)
    assert_close(back_q, q, atol=1e-5, rtol=1e-5, name="q")
    assert_close(back_k, k, atol=1e-5, rtol=1e-5, name="k")


def test_rope_torch_path_reads_transposed_views_without_copying():
    q, k, cos, sin, _, _ = _inputs(SHAPES[1], torch.float32, "1")
    assert not q.is_contiguous()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        apply_rope(q.requires_grad_(True), k, cos, sin, backend="torch")
    assert [tuple(t.shape) for t in saved] == [tuple(cos.shape), tuple(sin.shape)]  # no q/k


def test_rope_errors_name_the_problem():
    q, k, cos, sin, _, _ = _inputs(SHAPES[1], torch.float32, "B")
    with pytest.raises(ValueError, match=r"cos must be \(3 or 1, 37, 130\)"):
        apply_rope(q, k, cos[:, :5], sin)
    with pytest.raises(ValueError, match="does not match q"):
        apply_rope(q, k[:, :, :5], cos, sin)
    with pytest.raises(ValueError, match="even"):
        apply_rope(q[..., :5], k[..., :5], cos[..., :5], sin[..., :5])
    with pytest.raises(ValueError, match="share a float dtype"):
        apply_rope(q, k.double(), cos, sin)
    with pytest.raises(ValueError, match="requires grad"):
        apply_rope(q, k, cos.clone().requires_grad_(True), sin)


@pytest.mark.cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40, 8])
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_stepwise_kernel_is_transformers_rope_bit_for_bit(dtype, head_dim, cos_batch):
    """``rope_stepwise`` (the lean decoding step's RoPE) rounds each product, then their sum, as
    ``apply_rotary_pos_emb`` does in bf16 / fp16: equal bit for bit, vector body and tail
    (head_dim 40: 16 lanes then 4), on transformers' own rotary tables at far positions."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from lorafuse import backends

    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")
    (kernel,) = backends.compiled("rope", "cpp", "stepwise")
    torch.manual_seed(head_dim)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4))
    positions = torch.arange(1000, 1003)[None].expand(cos_batch, 3)
    cos, sin = rotary(torch.zeros(1, dtype=dtype), positions)  # (cos_batch, 3, head_dim)
    q = (torch.randn(2, 4, 3, head_dim) * 3).to(dtype)
    k = (torch.randn(2, 2, 3, head_dim) * 3).to(dtype)
    ours, theirs = kernel(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    with pytest.raises(RuntimeError, match="rope_stepwise: q must be bfloat16 or float16"):
        kernel(q.float(), k.float(), cos.float(), sin.float())
