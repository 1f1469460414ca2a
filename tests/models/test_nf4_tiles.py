"""NF4 base weights multiplied tile by tile inside the fused ops (ops/lora_split.py).

Where a quantized weight's dense copy would be larger than one tile (``weights.TILE_BYTES``),
``lora_linear``, ``lora_qkv`` and ``lora_mlp`` dequantize it one row tile at a time in forward and
one column tile at a time in backward. Here the tile is shrunk so small weights split: the
outputs and gradients must match the whole-weight path (the fused kernels), no dense copy may be
larger than a tile, and the column dequantiser must give the whole weight's values bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from lorafuse.models.nf4 import NF4Weight
from lorafuse.ops import weights
from lorafuse.ops.lora_linear import lora_linear
from lorafuse.ops.lora_mlp import LoRAParams, lora_mlp
from lorafuse.ops.lora_qkv import lora_qkv
from lorafuse.ops.nf4 import dequantize_nf4_columns, quantize_nf4
from lorafuse.testing import assert_close, nf4_dense_copies, op_cases, rms_error

CASES = op_cases("lora_linear", "swiglu")
D, INTER = 128, 256  # row tiles start at NF4 double-quantisation groups: 128 rows at 128 columns


def _nf4(w: torch.Tensor, dtype) -> NF4Weight:
    return NF4Weight(**quantize_nf4(w.float()), shape=w.shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(96, 512), (256, 192), (40, 64)])
def test_dequantize_columns_is_the_whole_weights_columns(shape, dtype):
    w = _nf4(torch.randn(shape, generator=torch.Generator().manual_seed(0)), dtype)
    whole = w.dequantize(dtype)
    for start, stop in [(0, 64), (64, shape[1]), (0, shape[1])]:
        if stop <= start:
            continue
        got = w.dequantize_columns(start, stop, dtype)  # the C++ kernel where it is built
        assert torch.equal(got, whole[:, start:stop]), (start, stop)
        buf = (w.codes, w.absmax_q, w.absmax_scale, w.absmax_offset)
        torch_code = dequantize_nf4_columns(*buf, w.shape, start, stop, dtype)
        assert torch.equal(torch_code, whole[:, start:stop]), (start, stop)


def test_dequantize_columns_refuses_unaligned_ranges():
    w = _nf4(torch.randn(8, 128), torch.float32)
    for start, stop in [(1, 64), (0, 65), (64, 64), (0, 192)]:
        with pytest.raises(ValueError, match="multiples of 64"):
            w.dequantize_columns(start, stop)
    straddling = _nf4(torch.randn(8, 96), torch.float32)  # blocks of 64 straddle rows
    assert straddling.column_alignment is None
    with pytest.raises(ValueError, match="whole blocks per row"):
        straddling.dequantize_columns(0, 64)


def test_tiled_only_quantized_cpu_weights_larger_than_a_tile(monkeypatch):
    monkeypatch.setattr(weights, "TILE_BYTES", 1 << 14)
    big = _nf4(torch.randn(INTER, D), torch.float32)  # 128 KiB dense
    assert weights.tiled(big, torch.float32)
    assert not weights.tiled(big.rows(0, 16), torch.float32)  # 8 KiB: one copy
    assert not weights.tiled(torch.randn(INTER, D), torch.float32)  # dense already
    assert not weights.tiled(_nf4(torch.randn(INTER, 96), torch.float32), torch.float32)
    spans = [(a, b) for a, b, _ in weights.column_blocks(big, torch.float32, 1 << 14)]
    assert spans == [(0, 64), (64, 128)]  # 16 KiB tiles of 256 rows: 16 columns, aligned to 64


def _leaf(t, dtype, compute):
    """``t`` rounded to ``dtype``, held in ``compute`` (the oracle's fp32), a grad leaf."""
    return t.to(dtype).to(compute).requires_grad_(True)


def _proj(gen, d_in, d_out, dtypes, dropout_p, bias=False):
    dtype, adapter_dtype, compute = dtypes
    w = torch.randn(d_out, d_in, generator=gen) / d_in**0.5
    A = _leaf(torch.randn(4, d_in, generator=gen) / d_in**0.5, adapter_dtype, compute[1])
    B = _leaf(torch.randn(d_out, 4, generator=gen) / 2, adapter_dtype, compute[1])
    b = _leaf(0.1 * torch.randn(d_out, generator=gen), dtype, compute[0]) if bias else None
    return LoRAParams(_nf4(w, compute[0]), b, A, B, 2.0, dropout_p)


def _run(op, backend, dtype, adapter_dtype, dropout_p, oracle=False, seed=0):
    """Outputs and input/adapter/bias gradients of ``op`` ('linear', 'qkv', 'mlp') on NF4 weights;
    ``oracle``: the same rounded values computed in fp32."""
    gen = torch.Generator().manual_seed(seed)
    compute = (torch.float32,) * 2 if oracle else (dtype, adapter_dtype)
    dt = (dtype, adapter_dtype, compute)
    x = _leaf(torch.randn(2, 5, D, generator=gen), dtype, compute[0])
    if op == "linear":
        params = [_proj(gen, D, INTER, dt, dropout_p, bias=True)]
    elif op == "qkv":  # GQA widths; k and v (64 KiB in fp32) are not larger than a tile
        params = [_proj(gen, D, w, dt, dropout_p, bias=True) for w in (INTER, D, D)]
    else:
        params = [_proj(gen, D, INTER, dt, dropout_p) for _ in range(2)]
        params.append(_proj(gen, INTER, D, dt, dropout_p))
    torch.manual_seed(seed)  # the same dropout masks in every run
    if op == "linear":
        p = params[0]
        outs = [lora_linear(x, p.weight, p.bias, p.lora_A, p.lora_B, p.scaling, p.dropout_p,
                            backend=backend)]  # fmt: skip
    elif op == "qkv":
        outs = list(lora_qkv(x, *params, backend=backend))
    else:
        outs = [lora_mlp(x, *params, backend=backend)]
    loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs)
    leaves = [x] + [t for p in params for t in (p.bias, p.lora_A, p.lora_B) if t is not None]
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


def _oracle(op, backend, dtype, adapter_dtype, dropout_p, monkeypatch):
    """The same run in fp32 on the same (dequantized, rounded) weights: what bf16 is judged by."""
    whole = NF4Weight.dequantize
    monkeypatch.setattr(NF4Weight, "dequantize", lambda w, dt=None: whole(w, dtype).float())
    monkeypatch.setattr(weights, "TILE_BYTES", 1 << 40)  # whole dense copies
    out = _run(op, backend, dtype, adapter_dtype, dropout_p, oracle=True)
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("op", ["linear", "qkv", "mlp"])
@pytest.mark.parametrize(
    "dtype,adapter_dtype,dropout_p",
    [
        (torch.float32, torch.float32, 0.0),
        (torch.float32, torch.float32, 0.25),
        (torch.bfloat16, torch.float32, 0.0),  # PEFT's fp32 adapters on a bf16 base
        (torch.bfloat16, torch.float32, 0.25),
        (torch.bfloat16, torch.bfloat16, 0.0),
    ],
)
def test_tiles_match_the_whole_weight(op, backend, device, dtype, adapter_dtype, dropout_p,
                                      monkeypatch):  # fmt: skip
    if backend == "triton":
        pytest.skip("tiles run the torch/C++ split path on CPU; Triton keeps one dense copy")
    monkeypatch.setattr(weights, "TILE_BYTES", 1 << 40)  # no weight is larger: whole copies
    whole = _run(op, backend, dtype, adapter_dtype, dropout_p)
    tile = 16384 * dtype.itemsize  # every weight of INTER rows or columns splits in two
    monkeypatch.setattr(weights, "TILE_BYTES", tile)
    with nf4_dense_copies() as sizes:
        tiled = _run(op, backend, dtype, adapter_dtype, dropout_p)
    assert sizes and max(sizes) <= tile, sizes
    monkeypatch.undo()
    if dtype == torch.float32:  # the same products, up to summation order (the C++ kernel's
        # rank-r FMA passes against MKL here): relative to the tensor's scale, as the gradients
        # are sums that cancel (measured up to 5e-7 of the largest element, as the C++ and
        # torch kernels differ from each other on the whole weight)
        for i, (a, b) in enumerate(zip(tiled, whole)):
            scale = float(b.abs().max())
            assert_close(a, b, atol=1e-5 * scale, rtol=1e-5, name=f"{op} output/grad {i}")
        return
    # bf16 base: a tile's GEMM may sum in another order than the whole one, and where bf16
    # products are emulated the torch reference rounds its base product before adding the LoRA
    # term while the split path rounds once (as the C++ kernel): each is judged against the fp32
    # run on the same rounded weights and inputs (rms error; the fp32 adapter gradients too).
    oracle = _oracle(op, backend, dtype, adapter_dtype, dropout_p, monkeypatch)
    for i, (a, b, o) in enumerate(zip(tiled, whole, oracle)):
        err, err_whole = rms_error(a, o), rms_error(b, o)
        assert err <= 1.25 * err_whole + 1e-7 * float(o.abs().max()), (op, i, err, err_whole)
