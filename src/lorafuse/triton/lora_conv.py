"""Triton parts of the fused LoRA Conv2d: the rank-r up-projection, fused into the conv output.

Contract: :func:`lorafuse.ops.lora_conv._torch_forward` / ``_torch_backward``.
Shapes: x (N, Cin, H, W), W (Cout, Cin/groups, kh, kw), b (Cout,), down (r, Cin, kh, kw),
up (Cout, r, 1, 1), t = conv(x, down) (N, r, H', W'), g (N, Cout, H', W').

What is fused, honestly: the convolutions themselves (base, down, and their transposed
convolutions in backward) are torch's (cuDNN), which a hand-written Triton convolution would not
beat. The kernels here own the rank-r parts around them:

* ``_up_add_kernel`` (forward): ``y += s·up·t`` over (N, Cout, H'·W') tiles, *in place* on the
  base conv's output: the rank-r product is accumulated in fp32 registers (a short loop over r),
  added to the loaded ``y`` tile in fp32 and rounded once to y's dtype. No (N, Cout, H', W')
  temporary is written (the unfused module writes three: ``conv(t, up)``, ``* s``, the sum).
  It takes fp32 adapters on a bf16 base as they are (promoted in registers).
* ``_up_t_kernel`` (backward): ``gt = s·upᵀ·g`` (N, r, H', W') with the cast of g to the adapter
  dtype and the scaling done in registers: no adapter-dtype copy of g.

``d_up = s·Σ g·tᵀ`` is a reduction over N·H'·W' into a (Cout, r) output: ``torch.bmm`` and a sum
(cuBLAS splits the long reduction across the GPU, which a one-tile-per-output kernel would not).
``d_down`` and dx come from torch's ``convolution_backward``.

Tensors may be NCHW-contiguous or channels-last: the kernels index (n, c, h·W' + w) through
strides, which needs only ``stride(h) == W'·stride(w)`` (true for both layouts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lorafuse.ops.lora_conv import conv_backward  # the convolutions stay torch's: one copy
from lorafuse.triton._common import (
    cast_to,
    check_device,
    dot_acc,
    dot_precision,
    interpreted,
    pow2_at_least,
)


@triton.jit
def _up_add_kernel(
    Y, UP, T, C, R, HW, n_c, n_hw,
    syn, syc, syh, supc, supr, stn, str_, sth,
    scale,
    BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Y[n, C, HW] += scale · UP[C, R] · T[n, R, HW], one (BLOCK_C, BLOCK_HW) tile, in place."""
    pid = tl.program_id(0)
    n = pid // (n_c * n_hw)
    rest = pid % (n_c * n_hw)
    rc = (rest // n_hw) * BLOCK_C + tl.arange(0, BLOCK_C)
    rh = (rest % n_hw) * BLOCK_HW + tl.arange(0, BLOCK_HW)
    lora = tl.full((BLOCK_C, BLOCK_HW), 0.0, tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        up = tl.load(UP + rc[:, None] * supc + rr[None, :] * supr,
                     mask=(rc[:, None] < C) & (rr[None, :] < R), other=0.0)  # fmt: skip
        t = tl.load(T + n.to(tl.int64) * stn + rr[:, None] * str_ + rh[None, :].to(tl.int64) * sth,
                    mask=(rr[:, None] < R) & (rh[None, :] < HW), other=0.0)  # fmt: skip
        lora = dot_acc(up, t, lora, PREC)
    ok = (rc[:, None] < C) & (rh[None, :] < HW)
    y_ptr = Y + n.to(tl.int64) * syn + rc[:, None].to(tl.int64) * syc + rh[None, :] * syh
    y = tl.load(y_ptr, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr, cast_to(y + lora * scale, Y.dtype.element_ty), mask=ok)


@triton.jit
def _up_t_kernel(
    G, UP, OUT, C, R, HW, n_hw,
    sgn, sgc, sgh, supc, supr, son, sor, soh,
    scale,
    BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """OUT[n, R, HW] = scale · UP[C, R]ᵀ · G[n, C, HW], G cast to UP's dtype in registers."""
    pid = tl.program_id(0)
    n = pid // n_hw
    rh = (pid % n_hw) * BLOCK_HW + tl.arange(0, BLOCK_HW)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.full((BLOCK_R, BLOCK_HW), 0.0, tl.float32)
    for c0 in range(0, C, BLOCK_C):
        rc = c0 + tl.arange(0, BLOCK_C)
        upt = tl.load(
            UP + rc[None, :] * supc + rr[:, None] * supr,
            mask=(rc[None, :] < C) & (rr[:, None] < R),
            other=0.0,
        )  # (BLOCK_R, BLOCK_C)
        g = tl.load(G + n.to(tl.int64) * sgn + rc[:, None].to(tl.int64) * sgc + rh[None, :] * sgh,
                    mask=(rc[:, None] < C) & (rh[None, :] < HW), other=0.0)  # fmt: skip
        acc = dot_acc(upt, cast_to(g, upt.dtype), acc, PREC)  # like g.to(lora_up.dtype)
    o_ptr = OUT + n.to(tl.int64) * son + rr[:, None] * sor + rh[None, :].to(tl.int64) * soh
    tl.store(o_ptr, cast_to(acc * scale, OUT.dtype.element_ty),
             mask=(rr[:, None] < R) & (rh[None, :] < HW))  # fmt: skip


def _flat_strides(t: torch.Tensor, name: str) -> tuple[int, int, int]:
    """Strides of (n, c, h·W + w) for a 4-D tensor whose h and w steps merge (NCHW or NHWC)."""
    n, c, h, w = t.stride()
    if t.shape[2] > 1 and t.shape[3] > 1 and h != t.shape[3] * w:
        raise ValueError(f"lorafuse.triton.lora_conv2d: {name} strides {t.stride()} do not merge")
    return n, c, (w if t.shape[3] > 1 else h)


def _blocks(device, C, R, HW):
    """(BLOCK_C, BLOCK_HW, BLOCK_R). Untuned on a GPU (none here); the interpreter wants few,
    large programs, since its cost is per program."""
    block_r = min(64, pow2_at_least(R))
    if interpreted(device):
        return min(64, pow2_at_least(C)), min(64, pow2_at_least(HW)), block_r
    return 64, 64, block_r


def up_add_(y, t, lora_up, scaling):
    """``y += scaling·up ⊛ t`` in place (y (N, Cout, H', W'), t (N, r, H', W')); returns y."""
    n, cout = y.shape[:2]
    r = t.shape[1]
    hw = y.shape[2] * y.shape[3]
    up = lora_up.reshape(cout, r)  # (Cout, r)
    bc, bh, br = _blocks(y.device, cout, r, hw)
    n_c, n_hw = triton.cdiv(cout, bc), triton.cdiv(hw, bh)
    _up_add_kernel[(n * n_c * n_hw,)](
        y, up, t, cout, r, hw, n_c, n_hw,
        *_flat_strides(y, "y"), up.stride(0), up.stride(1), *_flat_strides(t, "t"),
        float(scaling),
        BLOCK_C=bc, BLOCK_HW=bh, BLOCK_R=br, PREC=dot_precision(t.dtype), num_warps=4,
    )  # fmt: skip
    return y


def up_t(g, lora_up, scaling, out_dtype):
    """``scaling·upᵀ·g`` (N, r, H', W') in ``out_dtype``, g (N, Cout, H', W')."""
    n, cout, h, w = g.shape
    r = lora_up.shape[1]
    up = lora_up.reshape(cout, r)  # (Cout, r)
    out = torch.empty((n, r, h, w), dtype=out_dtype, device=g.device)
    bc, bh, br = _blocks(g.device, cout, r, h * w)
    br = pow2_at_least(r)  # the whole rank in one tile: r is the output's channel count
    n_hw = triton.cdiv(h * w, bh)
    _up_t_kernel[(n * n_hw,)](
        g, up, out, cout, r, h * w, n_hw,
        *_flat_strides(g, "g"), up.stride(0), up.stride(1), *_flat_strides(out, "gt"),
        float(scaling),
        BLOCK_C=bc, BLOCK_HW=bh, BLOCK_R=br, PREC=dot_precision(up.dtype), num_warps=4,
    )  # fmt: skip
    return out


def forward(x, weight, bias, lora_down, lora_up, scaling, stride, padding, dilation, groups):
    """``(y (N, Cout, H', W') in x's dtype, t (N, r, H', W') in the adapter dtype)``."""
    check_device("lora_conv2d", x, weight, bias, lora_down, lora_up)
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)  # (N, Cout, H', W')
    t = F.conv2d(x.to(lora_down.dtype), lora_down, None, stride, padding, dilation)  # (N, r, ..)
    return up_add_(y, t, lora_up, scaling), t


def backward(g, x, weight, lora_down, lora_up, t, scaling, stride, padding, dilation, groups,
             needs):  # fmt: skip
    """``(dx, d_down, d_up, db)``, each None unless asked for in ``needs``."""
    need_dx, need_down, need_up, need_db = needs
    check_device("lora_conv2d", g, x, weight, lora_down, lora_up, t)
    adapter = lora_up.dtype
    dx = d_down = d_up = db = None
    if need_up:
        n, r = t.shape[:2]
        gl = g.to(adapter).reshape(n, g.shape[1], -1)  # (N, Cout, H'W')
        d_up = torch.bmm(gl, t.reshape(n, r, -1).transpose(1, 2)).sum(0).mul_(scaling)
        d_up = d_up.view(lora_up.shape)  # (Cout, r, 1, 1); per-image products, then summed
    if need_dx or need_down:
        gt = up_t(g, lora_up, scaling, adapter)  # (N, r, H', W')
        xl = x.to(adapter)  # recomputed, never saved
        dxl, d_down = conv_backward(
            gt, xl, lora_down, stride, padding, dilation, 1, need_dx, need_down
        )
    if need_dx:
        dx, _ = conv_backward(g, x, weight, stride, padding, dilation, groups, True, False)
        dx = dx.add_(dxl) if dx.dtype == dxl.dtype else (dx + dxl).to(x.dtype)
    if need_db:
        db = g.sum((0, 2, 3), dtype=torch.float32).to(g.dtype)  # (Cout,)
    return dx, d_down, d_up, db
