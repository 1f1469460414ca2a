"""Decode weight formats and their products (ops/quant_linear.py, csrc/decode_gemv*.cpp): every
CPU body (AVX-512, AVX2, plain C++) against the reference on odd shapes, the quantisers' error
bounds, and the checks."""

from __future__ import annotations

import pytest
import torch

from lorafuse import backends
from lorafuse.ops import quant_linear as q

pytestmark = pytest.mark.cpp


@pytest.fixture(autouse=True)
def _needs_cpp():
    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")


def _bodies() -> list[str]:
    if not backends.cpp_available():
        return ["scalar"]
    (isa,) = backends.compiled("decode_engine", "cpp", "gemv_isa")
    best = isa()
    return {"avx512": ["avx512", "avx2", "scalar"], "avx2": ["avx2", "scalar"]}.get(best, [best])


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def body(request):
    if request.param not in _bodies():
        pytest.skip(f"this CPU has no {request.param} body")
    (force,) = backends.compiled("decode_engine", "cpp", "set_gemv_isa")
    force(request.param)
    yield request.param
    force("auto")


@pytest.mark.parametrize("fmt", q.FORMATS)
@pytest.mark.parametrize("M,N,K", [(1, 1, 32), (1, 37, 64), (3, 100, 96), (8, 65, 576),
                                   (13, 33, 160), (16, 129, 1536)])  # fmt: skip
def test_products_are_the_fp32_sums_of_the_reference(body, fmt, M, N, K):
    """Each output within the fp32 summation bound of the float64 product of the very weights
    the reference dequantises (a wrong row, group, nibble or scale is far outside it). M past
    the kernel's 8 rows a pass and N not a multiple of its row blocks take every tail."""
    torch.manual_seed(M * 1000 + N + K)
    w = q.pack(torch.randn(N, K), fmt)
    x = torch.randn(M, K)
    y = q.quant_linear(x, w)
    dense = q.dequantize(w).double()
    bound = (x.double().abs() @ dense.abs().T) * K * 2**-23
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert ((y.double() - x.double() @ dense.T).abs() <= bound).all()
    wrong = q.dequantize(w).roll(1, 1).double()
    assert not ((y.double() - x.double() @ wrong.T).abs() <= bound).all()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_plain_formats_take_any_width(body, fmt):
    w = q.pack(torch.randn(20, 77), fmt)  # 77: no whole vector at the end of a row
    x = torch.randn(5, 77)
    y = q.quant_linear(x, w)
    assert torch.allclose(y, q.quant_linear_reference(x, w), rtol=1e-5, atol=1e-5)


def test_plain_formats_keep_the_tensor():
    w = torch.randn(8, 32)
    assert q.pack(w, "fp32").data.data_ptr() == w.data_ptr()  # the same storage, no copy
    assert q.pack(w.bfloat16(), "bf16").data.dtype == torch.bfloat16


def test_int8_error_is_at_most_half_a_step():
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 256)  # groups of very different scales
    p = q.quantize_int8(w)
    step = p.scales.repeat_interleave(q.GROUP, 1)  # (N, K)
    assert ((q.dequantize(p) - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert p.data.dtype == torch.int8 and p.nbytes() == 64 * 256 + 64 * 8 * 4


def test_q4_error_is_at_most_one_step_and_the_extreme_is_exact():
    """llama.cpp's q4_0 rule: scale = the extreme / -8, so the extreme maps to -8 exactly; the
    other values round to within half a step, except past +7 on the far side (one step)."""
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    p = q.quantize_q4(w)
    d = q.dequantize(p)
    step = p.scales.abs().repeat_interleave(q.GROUP, 1)
    assert ((d - w).abs() <= step * (1 + 1e-6)).all()
    groups, deq = w.reshape(64, 8, 32), d.reshape(64, 8, 32)
    idx = groups.abs().argmax(-1, keepdim=True)
    assert torch.equal(groups.gather(-1, idx), deq.gather(-1, idx))
    assert p.data.shape == (64, 128) and p.data.dtype == torch.uint8


def test_zero_groups_quantise_to_zero():
    w = torch.zeros(4, 64)
    for fmt in ("int8", "q4"):
        assert torch.equal(q.dequantize(q.pack(w, fmt)), w)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="in_features % 32"):
        q.quantize_int8(torch.randn(4, 33))
    with pytest.raises(ValueError, match="unknown weight format"):
        q.pack(torch.randn(4, 32), "int3")
    with pytest.raises(ValueError, match="x must be"):
        q.quant_linear(torch.randn(2, 31), q.pack(torch.randn(4, 32), "int8"))
