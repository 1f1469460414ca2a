"""Test helpers shared by lorafuse's own tests (and usable by anyone testing fused ops).

``assert_close`` reports max/mean difference and where; ``available_backends`` lists the kernel
backends that run on a device here; ``tiny_llama_config`` builds the tiny Llama used by fast tests.
"""

from __future__ import annotations

import torch


def assert_close(actual, expected, *, atol, rtol, name="tensor"):
    """Like torch.testing.assert_close, but the message says max/mean difference and where."""
    actual = actual.detach()
    expected = (
        expected.detach().to(actual.dtype) if expected.dtype != actual.dtype else expected.detach()
    )
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a = actual.double()
    e = expected.double()
    diff = (a - e).abs()
    bound = atol + rtol * e.abs()
    if bool(torch.isfinite(a).all()) and bool((diff <= bound).all()):
        return
    worst = int(torch.argmax(diff - bound).item()) if diff.numel() else 0
    where = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        if diff.numel()
        else ()
    )
    raise AssertionError(
        f"{name}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}, "
        f"worst at {where}: got {a.flatten()[worst].item():.6e}, expected {e.flatten()[worst].item():.6e} "
        f"(atol={atol}, rtol={rtol}); non-finite: {int((~torch.isfinite(a)).sum())}"
    )


def available_backends(device="cpu"):
    """Backends that can run on ``device`` in this test session (torch always)."""
    from lorafuse import backends

    found = ["torch"]
    if "cpp" in backends.KERNELS and backends.cpp_available():
        found.append("cpp")
    if backends.triton_runs_on(torch.device(device)):
        found.append("triton")
    return found


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    cfg = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def single_thread():
    """Generator for an autouse fixture: run a test on one torch thread, then restore.

    Tiny models gain nothing from threads, and on a shared 2-core CI box OpenMP barriers under
    oversubscription made each tiny op ~60x slower (measured: 21 s vs 0.35 s).
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
