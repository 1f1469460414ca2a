"""int8 products of a frozen base weight: the forward ``x·Wᵀ (+ b)`` and the input gradient
``g·W``, each with the row-varying operand quantized per row on the fly.

Shapes: x (N, in), g (N, out), W (out, in). The weight is quantized once (:func:`quantize_weight`):
``sw`` (out,) fp32 = max|W[o, :]| / 127 and ``wq`` (out, in) int8 = round(W / sw) in [-127, 127]
(rounding to nearest even). Per call:

* forward: ``xq, sx = quantize_rows(x)`` (sx[n] = max|x[n, :]| / 127), the int32 product
  ``acc = xq·wqᵀ``, then ``y = acc · (sx[n]·sw[o]) (+ b)`` in fp32, rounded once to x's dtype;
* input gradient: ``gq, sg = quantize_rows(g·diag(sw))``, ``acc = gq·wq``, ``dx = acc · sg[n]``
  (added, in fp32 and rounded once, into a running sum of the projections of one input).

The integer products are exact, so the only error is the rounding of x (or g) and W to 8 bits
(measured against bf16 training in docs/benchmarks.md). Nothing is saved for backward but g:
the weight's int8 operands are kept for both products (2 bytes a weight, as one bf16 copy).

The torch reference below is the test oracle and runs where the C++ kernel cannot (its integer
product in float64, exact; slow). The C++ kernel (``csrc/int8_linear.cpp``) runs the products in
oneDNN's int8 micro-kernel (AMX-INT8, AVX-512-VNNI), on the operands it packs at quantization.
"""

from __future__ import annotations

import torch

from lorafuse import backends

OP = "int8_linear"


# ---- reference --------------------------------------------------------------------------------
def quantize_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 (N, K), scale fp32 (N,))`` of fp32 ``v`` (N, K): q = round(v·127/max|v_n|)."""
    amax = v.abs().amax(1)  # (N,)
    # tensor / tensor: a true division, as the kernel's 127.f / amax (``127.0 / amax`` is torch's
    # reciprocal times 127, an ulp off, which flips the rounding of exact ties such as 63.5)
    inv = torch.where(amax > 0, amax.new_full((), 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(v * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wq int8 (out, in), sw fp32 (out,))``: per output row, as :func:`quantize_rows`."""
    return quantize_rows(weight.float())


def forward_reference(x, wq, sw, bias=None) -> torch.Tensor:
    """``y (N, out)`` in x's dtype (module docstring); the integer product exact in float64."""
    xq, sx = quantize_rows(x.float())
    acc = (xq.double() @ wq.double().t()).float()  # (N, out): exact integers
    y = acc * (sx[:, None] * sw[None, :])
    if bias is not None:
        y = y + bias.to(x.dtype).float()
    return y.to(x.dtype)


def input_grad_reference(g, wq, sw, into=None) -> torch.Tensor:
    """``dx (N, in)`` in g's dtype, or ``into + dx`` (summed in fp32, rounded once)."""
    gq, sg = quantize_rows(g.float() * sw[None, :])
    dx = (gq.double() @ wq.double()).float() * sg[:, None]  # (N, in)
    if into is not None:
        dx = into.float() + dx
    return dx.to(g.dtype)


# ---- autograd: a plain frozen Linear (the layers without an adapter) ---------------------------
class Int8LinearFunction(torch.autograd.Function):
    """``x·Wᵀ + b`` for a frozen int8 ``W``: saves nothing; backward only ``dx``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight = weight
        return weight.linear(x, bias)

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return ctx.weight.input_grad(g.contiguous()), None, None


# ---- checks and entry points ------------------------------------------------------------------
def _check(t: torch.Tensor, columns: int, what: str) -> None:
    if t.dim() != 2 or t.shape[1] != columns:
        raise ValueError(f"{what} must be (N, {columns}), got {tuple(t.shape)}")
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{what} must be float32 or bfloat16, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"int8 products run on CPU tensors, got {what} on {t.device}")


def available() -> bool:
    """Whether the int8 products run here at speed: the C++ kernel builds and its self-test
    passes (oneDNN's int8 micro-kernel: AMX-INT8 or AVX-512-VNNI)."""
    return backends.cpp_ready(OP)


def pack(weight: torch.Tensor, backend: str | None = None) -> dict[str, torch.Tensor]:
    """The int8 operands of ``weight`` (out, in): ``sw``, and for the C++ kernel the packed forward
    and backward operands with their compensations (``csrc/int8_linear.cpp``), else ``wq``. The
    backend is chosen here, once per weight: the operands' layout is the kernel's."""
    if backends.select_cpu(OP, backend) == "cpp":
        (quantize,) = backends.compiled(OP, "cpp", "quantize_weight")
        sw, fwd, comp_fwd, bwd, comp_bwd = quantize(weight.detach())
        return {"sw": sw, "fwd": fwd, "comp_fwd": comp_fwd, "bwd": bwd, "comp_bwd": comp_bwd}
    wq, sw = quantize_weight(weight.detach())
    return {"sw": sw, "wq": wq}


def unpack(ops: dict[str, torch.Tensor], shape) -> torch.Tensor:
    """``wq`` (out, in) int8 of :func:`pack`'s operands (from the packed backward operand: panels
    of 64 columns of ``wq``, rows in groups of 4 interleaved)."""
    if "wq" in ops:
        return ops["wq"]
    out, n_in = shape
    rows = -(-out // 4) * 4
    panels = ops["bwd"].view(-1, rows // 4, 64, 4)  # (P, rows/4, 64, 4)
    return panels.permute(1, 3, 0, 2).reshape(rows, -1)[:out, :n_in]


def linear(x: torch.Tensor, ops: dict[str, torch.Tensor], shape, bias=None) -> torch.Tensor:
    """``x (N, in) · Wᵀ (+ bias)`` -> (N, out) in x's dtype with :func:`pack`'s operands."""
    _check(x, shape[1], "x")
    x = x.contiguous()
    if "wq" in ops:
        return forward_reference(x, ops["wq"], ops["sw"], bias)
    (forward,) = backends.compiled(OP, "cpp", "forward")
    return forward(x, ops["sw"], ops["fwd"], ops["comp_fwd"], bias)


def input_grad(g: torch.Tensor, ops: dict[str, torch.Tensor], shape, into=None) -> torch.Tensor:
    """``g (N, out) · W`` -> (N, in) in g's dtype, or added into ``into`` (same shape and
    dtype)."""
    _check(g, shape[0], "g")
    g = g.contiguous()
    if into is not None and (into.dtype != g.dtype or not into.is_contiguous()):
        return into.add_(input_grad(g, ops, shape))
    if "wq" in ops:
        dx = input_grad_reference(g, ops["wq"], ops["sw"], into)
        return dx if into is None else into.copy_(dx)
    (grad,) = backends.compiled(OP, "cpp", "input_grad")
    return grad(g, ops["sw"], ops["bwd"], ops["comp_bwd"], shape[1], into)
