"""Fused LoRA Conv2d: ``y = conv(x, W, b) + s·up ⊛ conv(x, down)`` with a hand-written backward.

Shapes: x (N, Cin, H, W) (or unbatched), W (Cout, Cin/groups, kh, kw), b (Cout,), down (r, Cin,
kh, kw) with the layer's stride/padding/dilation, up (Cout, r, 1, 1) -> y (N, Cout, H', W').
Saved for backward: ``x`` once and ``t = conv(x, down)`` (N, r, H', W'); frozen W and b get no
gradient and no copy. Zero padding only. What fusion buys, the backward, autocast and the C++
fast path: docs/kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import has_torch_function_variadic

from lorafuse import backends
from lorafuse.ops import autocast, custom_ops

# ---- Policy: the plain call runs as one C++ autograd Function (csrc/lora_autograd.cpp) ----


def _int_pair(v) -> tuple[int, int] | None:
    """``v`` as a pair of ints when it is an int or a tuple of two; else None (the general path
    checks it and raises)."""
    if type(v) is int:
        return v, v
    if type(v) is tuple and len(v) == 2 and type(v[0]) is int and type(v[1]) is int:
        return v
    return None


def _fast(x, weight, bias, lora_down, lora_up, scaling, stride, padding, dilation, groups,
          backend):  # fmt: skip
    """The call through ``csrc/lora_autograd.cpp`` (docs/kernels.md), or None when it is
    not that call. The C++ entry point repeats :func:`_check`'s tests as a yes/no (and checks
    autocast and that x is batched), so anything it declines runs the general path, which
    raises the errors."""
    geometry = (_int_pair(stride), _int_pair(padding), _int_pair(dilation))
    if (
        None in geometry
        or type(groups) is not int
        or custom_ops.active()
        or has_torch_function_variadic(x, weight, bias, lora_down, lora_up)  # subclasses, modes
        or backends.select_cpu("lora_conv2d", backend) != "cpp"
    ):
        return None
    (fast,) = backends.compiled("lora_conv2d", "cpp", "fast")
    return fast(x, weight, bias, lora_down, lora_up, float(scaling), *geometry, groups)


# ---- The op: reference, autograd.Function, entry point ------------------------------------


def lora_conv2d_reference(
    x, weight, bias, lora_down, lora_up, scaling, stride=1, padding=0, dilation=1, groups=1
):
    """Plain autograd math, written as a kohya LoRA conv module computes it: the test oracle."""
    result = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    xl = x.to(lora_down.dtype)
    lora = F.conv2d(F.conv2d(xl, lora_down, None, stride, padding, dilation), lora_up)
    return (result + lora * scaling).to(result.dtype)


def _up2d(lora_up):
    return lora_up.reshape(lora_up.shape[0], lora_up.shape[1])  # (Cout, r)


def _accumulate_up(y, t, lora_up, scaling):
    """``y + s·up ⊛ t`` in y's dtype, accumulated by one ``baddbmm_``.  y (N, Cout, H', W')

    Same dtypes and an NCHW ``y``: in place on y (no temporary the size of y). fp32 adapters on
    a bf16 base: into ONE promoted copy of y, rounded once at the end as the reference rounds
    (the unfused sum makes three: the up-projection, its scaled copy and the sum).
    """
    n, r = t.shape[:2]
    wide = torch.promote_types(y.dtype, t.dtype)
    up = _up2d(lora_up).to(wide)  # (Cout, r)
    acc = y.reshape(n, y.shape[1], -1).to(wide)  # (N, Cout, H'W'): a view of y when it can be
    acc.baddbmm_(up.expand(n, *up.shape), t.reshape(n, r, -1).to(wide), alpha=scaling)
    return acc.view(y.shape).to(y.dtype)


def _pointwise(weight, stride, padding, groups) -> bool:
    """A 1x1, stride-1, unpadded, ungrouped conv (SD1.5's ``proj_in``/``proj_out``): a per-image
    matrix product over channels, run as one here (dilation does not act on a 1x1 kernel).

    Why: the same products without the convolution machinery (no per-call algorithm choice,
    no im2col buffers). ``benchmarks/ops/lora_conv.py`` (fwd+bwd at SD1.5's 128 px shapes,
    batch 1, fp32, 1 thread): time vs the conv path 0.90 at 320 ch @ 16x16 r=8, 0.95-1.04
    elsewhere: a small gain where the token count is largest, neutral where per-call costs
    dominate.
    """
    geometry = (tuple(weight.shape[2:]), tuple(stride), tuple(padding), groups)
    return geometry == ((1, 1), (1, 1), (0, 0), 1)


def _bmm(w2, x3, bias=None):
    """``w2 @ x3[n] (+ bias)`` for every image: w2 (M, K), x3 (N, K, L) -> (N, M, L)."""
    w = w2.expand(x3.shape[0], *w2.shape)  # (N, M, K), a stride-0 view: no copy
    if bias is None:
        return torch.bmm(w, x3)
    return torch.baddbmm(bias.view(1, -1, 1), w, x3)


def _torch_forward(x, weight, bias, lora_down, lora_up, scaling, stride, padding, dilation, groups):
    """Returns ``(y, t)``: y (N, Cout, H', W') in x's dtype, t = conv(x, down) (N, r, H', W')."""
    if _pointwise(weight, stride, padding, groups):
        n, cin, h, w = x.shape
        x3 = x.reshape(n, cin, h * w)  # (N, Cin, HW); a view for NCHW and channels-last x
        y = _bmm(weight.reshape(weight.shape[:2]), x3, bias).view(n, -1, h, w)  # (N, Cout, H, W)
        down = lora_down.reshape(lora_down.shape[:2])  # (r, Cin)
        t = _bmm(down, x3.to(down.dtype)).view(n, -1, h, w)  # (N, r, H, W)
        return _accumulate_up(y, t, lora_up, scaling), t
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)  # (N, Cout, H', W')
    t = F.conv2d(x.to(lora_down.dtype), lora_down, None, stride, padding, dilation)  # (N, r, ..)
    return _accumulate_up(y, t, lora_up, scaling), t


def _pointwise_backward(g3, x, weight, lora_down, gt3, need_dx, need_down):
    """The 1x1 case of ``d_down`` and ``dx`` (see :func:`_pointwise`): g3 (N, Cout, HW),
    gt3 = s·upᵀ·g (N, r, HW); ``d_down = Σ_n gt3[n]·x3[n]ᵀ``, ``dx = Wᵀ·g3 + downᵀ·gt3``."""
    n, cin, h, w = x.shape
    down = lora_down.reshape(lora_down.shape[:2])  # (r, Cin)
    xl3 = x.reshape(n, cin, h * w).to(down.dtype)  # (N, Cin, HW), recomputed, never saved
    d_down = dx = None
    if need_down:
        d_down = torch.bmm(gt3, xl3.transpose(1, 2)).sum(0).view(lora_down.shape)  # (r, Cin,1,1)
    if need_dx:
        dx = _bmm(weight.reshape(weight.shape[:2]).t(), g3)  # (N, Cin, HW)
        if dx.dtype == gt3.dtype:
            dx.baddbmm_(down.t().expand(n, cin, down.shape[0]), gt3)  # LoRA part in place
        else:
            dx = (dx + _bmm(down.t(), gt3)).to(x.dtype)
        dx = dx.view(x.shape)
    return dx, d_down


def conv_backward(g, x, weight, stride, padding, dilation, groups, need_input, need_weight):
    """``(d input, d weight)`` of ``conv2d(x, weight)`` for grad ``g``; None where not asked."""
    dx, dw, _ = torch.ops.aten.convolution_backward(
        g, x, weight, None, list(stride), list(padding), list(dilation), False, [0, 0], groups,
        [need_input, need_weight, False],
    )  # fmt: skip
    return dx, dw


def _torch_backward(g, x, weight, lora_down, lora_up, t, scaling, stride, padding, dilation,
                    groups, needs):  # fmt: skip
    """Gradients ``(dx, d_down, d_up, db)``, each None unless asked for in ``needs``."""
    need_dx, need_down, need_up, need_db = needs
    dx = d_down = d_up = db = None
    n, r = t.shape[:2]
    gl = g.to(lora_up.dtype).reshape(n, g.shape[1], -1)  # (N, Cout, H'W')
    if need_up:
        t3 = t.reshape(n, r, -1)  # (N, r, H'W')
        # per-image (Cout, r) products, then summed: no permuted copy of g, as einsum would make
        d_up = torch.bmm(gl, t3.transpose(1, 2)).sum(0).mul_(scaling).view(lora_up.shape)
    if need_dx or need_down:
        gt = torch.matmul(_up2d(lora_up).t(), gl).mul_(scaling)  # (N, r, H'W')
        if _pointwise(weight, stride, padding, groups):
            g3 = g.reshape(gl.shape)  # (N, Cout, HW) in x's dtype
            dx, d_down = _pointwise_backward(g3, x, weight, lora_down, gt, need_dx, need_down)
        else:
            xl = x.to(lora_down.dtype)  # recomputed, never saved
            dxl, d_down = conv_backward(
                gt.view(t.shape), xl, lora_down, stride, padding, dilation, 1, need_dx, need_down
            )
            if need_dx:
                dx, _ = conv_backward(g, x, weight, stride, padding, dilation, groups, True, False)
                dx = dx.add_(dxl) if dx.dtype == dxl.dtype else (dx + dxl).to(x.dtype)
    if need_db:
        db = g.sum((0, 2, 3), dtype=torch.float32).to(g.dtype)  # (Cout,)
    return dx, d_down, d_up, db


def _implementation(backend: str):
    if backend == "torch":
        return _torch_forward, _torch_backward
    return backends.compiled("lora_conv2d", backend, "forward", "backward")


class LoRAConv2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_down, lora_up, scaling, geometry, backend):
        # geometry: (stride, padding, dilation) pairs and groups, as the kernels take them
        fwd, _ = _implementation(backend)
        y, t = fwd(x, weight, bias, lora_down, lora_up, float(scaling), *geometry)
        ctx.save_for_backward(x, weight, lora_down, lora_up, t)
        ctx.scaling, ctx.geometry, ctx.backend = float(scaling), geometry, backend
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, lora_down, lora_up, t = ctx.saved_tensors
        needs = ctx.needs_input_grad
        want = (needs[0], needs[3], needs[4], needs[2])  # dx, d_down, d_up, db
        _, bwd = _implementation(ctx.backend)
        with autocast.disabled(x.device):  # a backward called inside autocast: same dtypes
            dx, d_down, d_up, db = bwd(
                g.contiguous(), x, weight, lora_down, lora_up, t, ctx.scaling, *ctx.geometry, want
            )
        return dx, None, db, d_down, d_up, None, None, None


def _pair(v, name: str) -> tuple[int, int]:
    pair = (v, v) if isinstance(v, int) else tuple(v)
    if len(pair) != 2 or not all(isinstance(i, int) for i in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
    return pair  # type: ignore[return-value]


def _check(x, weight, bias, down, up, stride, padding, dilation, groups):
    if x.dim() != 4:
        raise ValueError(f"x must be (N, Cin, H, W) or (Cin, H, W), got {tuple(x.shape)}")
    cin = x.shape[1]
    if weight.dim() != 4 or groups < 1 or cin % groups or weight.shape[1] != cin // groups:
        raise ValueError(
            f"weight must be (Cout, {cin}/groups, kh, kw) with groups={groups} dividing {cin} "
            f"for input {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    cout, _, kh, kw = weight.shape
    if cout % groups:
        raise ValueError(f"weight {tuple(weight.shape)}: Cout={cout} not divisible by {groups=}")
    if down.dim() != 4 or tuple(down.shape[1:]) != (cin, kh, kw):
        raise ValueError(f"lora_down must be (r, {cin}, {kh}, {kw}), got {tuple(down.shape)}")
    r = down.shape[0]
    if tuple(up.shape) != (cout, r, 1, 1):
        raise ValueError(
            f"lora_up must be ({cout}, {r}, 1, 1) for weight {tuple(weight.shape)} and "
            f"lora_down {tuple(down.shape)}, got {tuple(up.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (cout,):
        raise ValueError(f"bias must be ({cout},), got {tuple(bias.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"input dtype {x.dtype} does not match weight dtype {weight.dtype}")
    if weight.requires_grad and torch.is_grad_enabled():
        # No base-weight gradient is computed: refuse rather than freeze it silently.
        raise ValueError(
            "weight requires grad, but lora_conv2d treats the base weight as frozen; "
            "freeze it (weight.requires_grad_(False)) or run the layer unfused"
        )
    if down.dtype != up.dtype:
        raise ValueError(f"lora_down ({down.dtype}) and lora_up ({up.dtype}) dtypes differ")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise ValueError(f"bad geometry: stride={stride} padding={padding} dilation={dilation}")
    out = [
        (x.shape[2 + i] + 2 * padding[i] - dilation[i] * (k - 1) - 1) // stride[i] + 1
        for i, k in enumerate((kh, kw))
    ]
    if min(out) < 1:
        raise ValueError(
            f"input {tuple(x.shape)} is too small for a {kh}x{kw} kernel with padding={padding}, "
            f"dilation={dilation}: output size {tuple(out)}"
        )


def lora_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_down: torch.Tensor,
    lora_up: torch.Tensor,
    scaling: float = 1.0,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
    backend: str | None = None,
) -> torch.Tensor:
    """``conv2d(x, W, b) + scaling·conv2d(conv2d(x, down), up)`` (the conv's geometry for both)."""
    if x.is_cpu:
        y = _fast(x, weight, bias, lora_down, lora_up, scaling, stride, padding, dilation, groups,
                  backend)  # fmt: skip
        if y is not None:
            return y
    dt = autocast.autocast_dtype(x)
    if dt is not None:  # as autocast runs F.conv2d: operands in its dtype, then autocast off
        with autocast.disabled(x.device):
            args = (autocast.cast(t, dt) for t in (x, weight, bias, lora_down, lora_up))
            return lora_conv2d(*args, scaling, stride, padding, dilation, groups, backend)
    geometry = (_pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"))
    unbatched = x.dim() == 3
    x4 = x.unsqueeze(0) if unbatched else x  # (N, Cin, H, W)
    _check(x4, weight, bias, lora_down, lora_up, *geometry, groups)
    chosen = backends.select("lora_conv2d", x.device, backend)
    y = LoRAConv2dFunction.apply(
        x4, weight, bias, lora_down, lora_up, scaling, (*geometry, int(groups)), chosen
    )
    return y.squeeze(0) if unbatched else y
