"""NF4 routed experts for QLoRA on mixture-of-experts models: the fused 3-D expert tensors (the
bulk of an MoE's weights) in 4 bit, dequantised one expert at a time by the fused expert op.

Each expert's (a, b) matrix is quantised on its own (:func:`lorafuse.ops.nf4.quantize_nf4`: its own
64-blocks and double-quantisation groups), and the buffers are stacked one row per expert, so
expert e is :class:`~lorafuse.models.nf4.NF4Weight` over row e (:meth:`NF4Experts.expert`) and the
C++ kernel dequantises exactly the experts that received tokens, one at a time, into a transient
buffer (``csrc/moe_lora.cpp``). 0.516 bytes per weight against bf16's 2.

The experts module keeps its parameter *names* (PEFT's ``target_parameters`` find them, and read
their shape, dtype and device for the adapters) as zero-stride placeholders of the right shape
that hold 2 bytes; the weights live in buffers ``nf4_<name>_{codes,absmax_q,absmax_scale,
absmax_offset}`` (following ``.to()``, in ``state_dict``), read through
``module.lorafuse_nf4_experts`` (:class:`NF4ExpertsView`). Its forward is the fused op, for good
(:func:`lorafuse.patching.moe.bind_quantized`); PEFT's own ParamWrapper forward, which would
read the placeholders, raises instead.
"""

from __future__ import annotations

import torch
from torch import nn

from lorafuse.models.nf4 import NF4Weight, register_nf4_buffers
from lorafuse.ops.nf4 import quantize_nf4
from lorafuse.patching import moe

_KEYS = ("codes", "absmax_q", "absmax_scale", "absmax_offset")


class NF4Experts:
    """A quantised expert stack (the op's ``ExpertStack.weight``): ``.shape`` (E, a, b) as
    stored, ``.expert(e)`` an NF4Weight (a, b), ``.buffers()`` the stacked buffers."""

    def __init__(self, codes, absmax_q, absmax_scale, absmax_offset, shape, dtype):
        self.codes, self.absmax_q = codes, absmax_q  # (E, ·) uint8, (E, ·) int8
        self.absmax_scale, self.absmax_offset = absmax_scale, absmax_offset  # (E, ·), (E,) fp32
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.requires_grad = False

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def expert(self, e: int) -> NF4Weight:
        return NF4Weight(self.codes[e], self.absmax_q[e], self.absmax_scale[e],
                         self.absmax_offset[e], self.shape[1:], self.dtype)  # fmt: skip

    def buffers(self) -> list[torch.Tensor]:
        return [self.codes, self.absmax_q, self.absmax_scale, self.absmax_offset]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense (E, a, b) stack (merging, the reference); transient."""
        return torch.stack([self.expert(e).dequantize(dtype).clone() for e in range(self.shape[0])])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def __repr__(self) -> str:
        return f"NF4Experts(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class NF4ExpertsView:
    """``module.lorafuse_nf4_experts``: ``.get(name)`` builds the :class:`NF4Experts` of the
    module's current buffers (so ``.to(device)`` is followed); ``names`` the quantised stacks."""

    def __init__(self, module: nn.Module, shapes: dict[str, tuple], dtype: torch.dtype):
        self.module, self.shapes, self.dtype = module, shapes, dtype

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    def get(self, name: str) -> NF4Experts | None:
        if name not in self.shapes:
            return None
        b = self.module._buffers
        codes, q, scale, offset = (b[f"nf4_{name}_{k}"] for k in _KEYS)
        return NF4Experts(codes, q, scale.view(torch.float32), offset.view(torch.float32),
                          self.shapes[name], self.dtype)  # fmt: skip

    def __bool__(self) -> bool:
        return bool(self.shapes)


def quantize_stack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """NF4 buffers of an (E, a, b) stack, one row per expert (each quantised on its own)."""
    per = [quantize_nf4(weight[e]) for e in range(weight.shape[0])]
    return {k: torch.stack([p[k] for p in per]) for k in _KEYS}


def quantize_experts_(model: nn.Module, compute_dtype: torch.dtype) -> tuple[int, int, int]:
    """NF4 for the expert stacks of every experts module the fused op computes (others stay
    dense); returns ``(stacks quantised, their NF4 bytes, their bytes in bf16)``."""
    n = nf4_bytes = dense = 0
    for module in model.modules():
        if not moe.is_experts(module) or moe.activation_of(module)[0] is None:
            continue
        shapes = {}
        for name in (moe.GATE_UP, moe.DOWN):
            param = module._parameters.get(name)
            if param is None or param.dim() != 3:
                continue
            buffers = quantize_stack(param.detach())
            register_nf4_buffers(module, {f"{name}_{k}": v for k, v in buffers.items()})
            shapes[name] = tuple(param.shape)
            placeholder = torch.zeros((), dtype=compute_dtype, device=param.device)
            module._parameters[name] = nn.Parameter(placeholder.expand(param.shape), False)
            nf4_bytes += sum(v.numel() * v.element_size() for v in buffers.values())
            dense += param.numel() * 2
            n += 1
        if shapes:
            module.lorafuse_nf4_experts = NF4ExpertsView(module, shapes, compute_dtype)
            moe.bind_quantized(module)
    return n, nf4_bytes, dense
