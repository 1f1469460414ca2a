"""Decoding's few-row product (ops/decode_linear.py, csrc/decode_linear.cpp): values, where it
applies and its errors (how models get it: tests/patching/test_decoding.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lorafuse import backends, hardware
from lorafuse.ops import decode_linear
from lorafuse.testing import within_fp32_sum_bound

pytestmark = pytest.mark.cpp


@pytest.fixture(autouse=True)
def _needs_cpp():
    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("k", [1, 15, 64, 200, 1536])
def test_rows_are_the_fp32_sum_rounded_once(dtype, rows, k):
    """Each output is the fp32 sum rounded once (within the bound against float64). A wrong row,
    tile, column or bias is off by far more. 1000 outputs: several tiles and threads, and a
    ragged last block of four rows; k = 1 and 15 cover the vector tail alone."""
    torch.manual_seed(rows * 1000 + k)
    w = torch.randn(1000, k, dtype=dtype) / k**0.5
    b = torch.randn(1000, dtype=dtype)
    x = torch.randn(rows, k, dtype=dtype)
    y = decode_linear.decode_linear(x, w, b)
    assert y.dtype == dtype and y.shape == (rows, 1000)
    assert within_fp32_sum_bound(y, x, w, b)
    assert within_fp32_sum_bound(decode_linear.decode_linear(x, w, None), x, w, None)
    wrong = decode_linear.decode_linear(x, w.roll(1, 0), b)  # the bound catches a wrong row
    assert not within_fp32_sum_bound(wrong, x, w, b)


def test_leading_dimensions_are_kept():
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    x = torch.randn(2, 1, 32, dtype=torch.bfloat16)
    y = decode_linear.decode_linear(x, w, None)
    assert y.shape == (2, 1, 48)
    assert torch.allclose(y.float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-6)


def test_applies_only_where_the_kernel_fits():
    bf = torch.bfloat16
    w = torch.zeros(16, 32, dtype=bf)
    x = torch.zeros(1, 1, 32, dtype=bf)
    limit = decode_linear.row_limit(bf)
    assert limit == (3 if hardware.native_low_precision_matmul("cpu", bf) else 8)
    with torch.no_grad():
        assert decode_linear.applies(x, w, None)
        assert decode_linear.applies(torch.zeros(limit, 32, dtype=bf), w, torch.zeros(16, dtype=bf))
        assert not decode_linear.applies(torch.zeros(limit + 1, 32, dtype=bf), w, None)  # prefill
        assert not decode_linear.applies(x.float(), w.float(), None)  # fp32: MKL's sgemv is fine
        assert not decode_linear.applies(x, w.float(), None)  # mixed dtypes
        assert not decode_linear.applies(x, w, torch.zeros(16))  # fp32 bias
        assert not decode_linear.applies(x, w.t().contiguous().t(), None)  # strided weight
    p = nn.Parameter(w.clone())  # a weight with a gradient to carry (full fine-tuning)
    assert not decode_linear.applies(x, p, None)
    assert not decode_linear.applies(x.clone().requires_grad_(), w, None)
    with torch.no_grad():
        assert decode_linear.applies(x, p, None)  # no autograd: no gradient to carry
    previous, decode_linear.MAX_ROWS = decode_linear.MAX_ROWS, 0
    try:
        assert not decode_linear.applies(x, w, None)
    finally:
        decode_linear.MAX_ROWS = previous


def test_kernel_errors_name_the_problem():
    (kernel,) = backends.compiled("decode_linear", "cpp", "forward")
    bf = torch.bfloat16
    w = torch.zeros(16, 32, dtype=bf)
    with pytest.raises(RuntimeError, match=r"takes 1 to 8 rows, got 9"):
        kernel(torch.zeros(9, 32, dtype=bf), w, None)
    with pytest.raises(RuntimeError, match=r"x must be a contiguous CPU \(\.\.\., 32\) tensor"):
        kernel(torch.zeros(1, 31, dtype=bf), w, None)
    with pytest.raises(RuntimeError, match=r"x must be a contiguous CPU \(\.\.\., 32\) tensor"):
        kernel(torch.zeros(32, 2, dtype=bf).t(), w, None)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 or float16"):
        kernel(torch.zeros(1, 32), w.float(), None)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous CPU BFloat16"):
        kernel(torch.zeros(1, 32, dtype=bf), w.half(), None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \(16,\)"):
        kernel(torch.zeros(1, 32, dtype=bf), w, torch.zeros(15, dtype=bf))
