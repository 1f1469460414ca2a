"""NF4 decoding (csrc/decode_linear.cpp's nf4_decode_linear): a few rows without a gradient to
carry multiply from the codes, never through a dense copy, with nf4_dequantize's weights."""

from __future__ import annotations

import pytest
import torch

from lorafuse.models import nf4
from lorafuse.ops import nf4 as nf4_ops
from lorafuse.testing import within_fp32_sum_bound


@pytest.mark.cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_decode_rows_multiply_from_the_codes_without_a_dense_copy(monkeypatch, dtype, rows):
    """A few rows without autograd (decoding) take csrc/decode_linear.cpp: no dense weight is made,
    and each output is the fp32 sum over the dequantised weights rounded once (a wrong tile, row
    or bias is off by far more than that bound allows)."""
    from lorafuse import backends

    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")
    torch.manual_seed(3)
    q = nf4.Linear4bit(torch.nn.Linear(192, 1000, bias=True), dtype).to(dtype)  # 1000 rows: tiles
    dense = q.weight.dequantize(dtype)
    x = torch.randn(rows, 192, dtype=dtype)

    def no_dense(*_):
        raise AssertionError("dequantize() called on the decoding path")

    monkeypatch.setattr(nf4.NF4Weight, "dequantize", no_dense)
    with torch.inference_mode():
        y = q(x.view(rows, 1, 192)).view(rows, 1000)
    assert y.dtype == dtype
    assert within_fp32_sum_bound(y, x, dense, q.bias)
    with torch.no_grad():  # no_grad decodes too (and still makes no dense copy)
        assert torch.equal(q(x), y)
    monkeypatch.undo()  # with a gradient to carry, the autograd path (a dense copy) runs
    xg = x.clone().requires_grad_()
    y_auto = q(xg)
    assert y_auto.grad_fn is not None
    assert within_fp32_sum_bound(y_auto.detach(), x, dense, q.bias)


@pytest.mark.cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("simd", [True, False])
def test_decode_multiplies_exactly_the_dequantised_weights(dtype, simd):
    """Both bodies of the decoding kernel (simd: from the codes in registers where the CPU has
    AVX-512; else a dequantised tile) multiply nf4_dequantize's weights bit for bit: one-hot rows
    of x pick one weight per output (an exact fp32 sum), every column, 1-8 rows. 2112 columns
    (33 blocks a row): a run of 16 absmaxes straddles a double-quantisation scale. A NaN scale
    (256 blocks: rows 8-15 at 2048 columns) spoils exactly those outputs."""
    from lorafuse import backends

    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")
    (kernel,) = backends.compiled("nf4", "cpp", "decode_linear")
    torch.manual_seed(11)
    for n, k in [(1000, 192), (64, 2112), (64, 2048)]:
        buf = nf4_ops.quantize_nf4(
            torch.randn(n, k) * 0.02 * torch.rand(n, 1) ** 4
        )  # spread absmax
        if k == 2048:
            buf["absmax_scale"][1] = float("nan")
        dense = nf4_ops.dequantize_nf4(**buf, shape=(n, k), dtype=dtype)  # (n, k)
        codes = (buf["codes"], buf["absmax_q"], buf["absmax_scale"], buf["absmax_offset"], n)
        for rows in (1, 3, 8) if k != 2048 else ():
            for start in range(0, k, rows):
                cols = [(start + i) % k for i in range(rows)]
                x = torch.zeros(rows, k, dtype=dtype)
                x[range(rows), cols] = 1
                y = kernel(x, *codes, None, simd)  # (rows, n)
                assert torch.equal(y, dense[:, cols].t()), f"{n}x{k} rows {rows} cols {cols}"
        x, b = torch.randn(5, k, dtype=dtype), torch.randn(n, dtype=dtype)
        y = kernel(x, *codes, b, simd)
        assert y.isnan().any() == (k == 2048)
        assert within_fp32_sum_bound(y, x, dense, b)  # NaN exactly where float64 has it


@pytest.mark.cpp
def test_decode_path_only_where_the_kernel_applies():
    """More than DECODE_MAX_ROWS rows, fp32 inputs, in_features not a multiple of 64, or a
    gradient to carry take the dense path."""
    from lorafuse import backends

    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")
    q = nf4.Linear4bit(torch.nn.Linear(128, 16, bias=False), torch.bfloat16)
    w = q.weight
    bf = torch.bfloat16
    with torch.inference_mode():
        assert nf4_ops.decodes(torch.zeros(2, 4, 128, dtype=bf), w, None)
        assert not nf4_ops.decodes(torch.zeros(9, 128, dtype=bf), w, None)
        assert not nf4_ops.decodes(torch.zeros(1, 128), w, None)  # fp32: MKL's sgemv is fine
        assert not nf4_ops.decodes(torch.zeros(1, 128, dtype=bf), w, torch.zeros(16))  # fp32 bias
    odd = nf4.Linear4bit(torch.nn.Linear(96, 16, bias=False), bf).weight
    assert not nf4_ops.decodes(torch.zeros(1, 96, dtype=bf), odd, None)
    assert not nf4_ops.decodes(torch.zeros(1, 128, dtype=bf, requires_grad=True), w, None)
