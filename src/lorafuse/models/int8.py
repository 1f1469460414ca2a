"""int8 base weights whose frozen products run in int8 (``load_in_int8``): weight object,
``Linear8bit``, model quantiser.

The math and its kernels: :mod:`lorafuse.ops.int8_linear`. :class:`Int8Weight` is a quantized
weight of :mod:`lorafuse.ops.weights` that multiplies itself (``.linear``, ``.input_grad``): the
fused LoRA ops route its frozen products (forward and input gradient) to the int8 kernel and never
make it dense; ``.dequantize(dtype)`` gives the dense weight the int8 values stand for (merging,
DoRA's norm, an unpatched forward). It is an option, not a default: each product rounds its
activation rows to 8 bits (the quality trade against bf16 is measured in docs/benchmarks.md), and
it runs at speed only where oneDNN's int8 micro-kernel does (AMX-INT8, AVX-512-VNNI;
:func:`require_int8_products` refuses elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from lorafuse.errors import LorafuseError
from lorafuse.ops import int8_linear as kernels

KEYS = ("sw", "fwd", "comp_fwd", "bwd", "comp_bwd", "wq")  # the operands :func:`kernels.pack` gives


class Int8Weight:
    """A frozen int8 weight (see :mod:`lorafuse.ops.weights`): views of a Linear8bit's buffers."""

    def __init__(self, ops: dict[str, torch.Tensor], shape, dtype: torch.dtype):
        self.ops = ops
        self.shape = torch.Size(shape)
        self.dtype = dtype  # the compute dtype: what dequantize() returns by default
        self.requires_grad = False

    @property
    def device(self) -> torch.device:
        return self.ops["sw"].device

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense ``(out, in)`` ``wq · sw`` in ``dtype`` (default the compute dtype); transient."""
        wq = kernels.unpack(self.ops, self.shape)
        return (wq.float() * self.ops["sw"][:, None]).to(dtype or self.dtype)

    def linear(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        """``x (..., in) · Wᵀ (+ bias)`` in int8 products, in x's dtype."""
        y = kernels.linear(x.reshape(-1, self.shape[1]), self.ops, self.shape, bias)
        return y.view(*x.shape[:-1], self.shape[0])

    def input_grad(self, g: torch.Tensor, into=None) -> torch.Tensor:
        """``g (..., out) · W`` (..., in) in int8 products, in g's dtype, or added into ``into``
        (N, in)."""
        dx = kernels.input_grad(g.reshape(-1, self.shape[0]), self.ops, self.shape, into)
        return dx if into is not None else dx.view(*g.shape[:-1], self.shape[1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.ops.values())

    def __repr__(self) -> str:
        return f"Int8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class Linear8bit(nn.Linear):
    """An ``nn.Linear`` whose weight is held as int8 operands (buffers ``int8_<key>``); ``.weight``
    is an :class:`Int8Weight`. Subclassing ``nn.Linear`` keeps PEFT's LoRA dispatch working;
    ``nn.Linear.__init__`` is skipped so no dense weight Parameter exists."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype or linear.weight.dtype  # PEFT reads it (adapter dtype)
        for key, value in kernels.pack(linear.weight).items():  # sw as int32 bits: .to(bf16)
            bits = value.view(torch.int32) if value.is_floating_point() else value  # keeps it
            self.register_buffer(f"int8_{key}", bits)
        bias = linear.bias
        if bias is not None:
            bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_parameter("bias", bias)

    @property
    def weight(self) -> Int8Weight:  # type: ignore[override]
        ops = {k: self._buffers[f"int8_{k}"] for k in KEYS if f"int8_{k}" in self._buffers}
        ops["sw"] = ops["sw"].view(torch.float32)
        return Int8Weight(ops, (self.out_features, self.in_features), self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.Int8LinearFunction.apply(x.to(self.compute_dtype), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8")  # fmt: skip


def require_int8_products() -> None:
    """Refuse, with the reason, where the int8 products would not run at speed."""
    if not kernels.available():
        raise LorafuseError(
            "load_in_int8 needs the C++ int8 kernel and a CPU whose oneDNN int8 micro-kernel runs "
            "(AMX-INT8 or AVX-512-VNNI; lorafuse build-ext builds the kernels); not available "
            "here, train in bf16 or fp32 instead"
        )


def quantize_model_(
    model: nn.Module, compute_dtype: torch.dtype, skip: tuple[nn.Module, ...] = ()
) -> int:
    """Replace every ``nn.Linear`` of ``model`` (except ``skip``, e.g. the lm_head) by a
    Linear8bit, freeing each dense weight as it goes. Returns the number of layers quantised."""
    require_int8_products()
    skip_ids = {id(m) for m in skip}
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and id(mod) not in skip_ids]  # fmt: skip
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Linear8bit(mod, compute_dtype))
    return len(targets)


def quantized_weights(model: nn.Module) -> list[Int8Weight]:
    """Every int8 weight of ``model``."""
    return [m.weight for m in model.modules() if isinstance(m, Linear8bit)]
