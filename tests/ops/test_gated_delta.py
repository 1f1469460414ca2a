"""The gated delta rule's chunked reference against the fp64 recurrence (the oracle) and
transformers' own torch function, per packed example."""

import pytest
import torch

from lorafuse.ops.gated_delta import gated_delta_rule, gated_delta_rule_recurrent


def _inputs(b, t, hk, hv, dk, dv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, t, hv, generator=gen, dtype=dtype)  # log decay <= 0
    beta = torch.rand(b, t, hv, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("t", [1, 63, 64, 130])
def test_chunked_equals_recurrence_in_fp64(t, close):
    args = _inputs(2, t, 2, 4, 16, 8)
    state = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    o, s = gated_delta_rule(*args, initial_state=state, output_final_state=True)
    o_ref, s_ref = gated_delta_rule_recurrent(*args, initial_state=state, output_final_state=True)
    close(o, o_ref, atol=1e-12, rtol=1e-12)
    close(s, s_ref, atol=1e-12, rtol=1e-12)


def test_equals_transformers_torch_chunk_function():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _inputs(2, 77, 2, 4, 16, 8, torch.float32)
    o, s = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    o_hf, s_hf = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(o, o_hf, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s, s_hf, atol=1e-6, rtol=1e-5)


def test_packed_examples_restart_the_state(close):
    q, k, v, g, beta = _inputs(1, 70, 2, 4, 16, 8)
    cu = torch.tensor([0, 30, 31, 70])
    o, s = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone, s_alone = gated_delta_rule_recurrent(
            *(x[:, a:b] for x in (q, k, v, g, beta)), output_final_state=True
        )
        close(o[:, a:b], alone, atol=1e-12, rtol=1e-12)
        close(s[i], s_alone[0], atol=1e-12, rtol=1e-12)


def test_bad_shapes_name_them():
    q, k, v, g, beta = _inputs(2, 8, 2, 3, 16, 8)
    with pytest.raises(ValueError, match="multiple of Hk"):
        gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta = _inputs(2, 8, 2, 4, 16, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
