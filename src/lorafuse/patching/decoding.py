"""Decoding on CPU: every plain ``nn.Linear`` of a model gets an instance forward that sends a
few rows of bf16 / fp16 without a gradient to carry through :mod:`lorafuse.ops.decode_linear`
(where :func:`~lorafuse.ops.decode_linear.applies`) and everything else (prefill, training,
fp32, CUDA, torch.compile) through ``F.linear``. PEFT's LoRA layers call their base layer, so
adapters keep working; ``FastLanguageModel.from_pretrained`` and ``for_inference`` install it.
"""

from __future__ import annotations

import torch
from torch import nn

from lorafuse import backends
from lorafuse.ops import decode_linear as op
from lorafuse.patching.peft_lora import install_forward, is_installed, original_forward


def _forward(self: nn.Linear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    # Under torch.compile the graph keeps F.linear: the kernel is no custom op (decoding is eager).
    if (
        not args
        and not kwargs
        and not torch.compiler.is_compiling()
        and op.applies(x, self.weight, self.bias)
    ):
        return op.decode_linear(x, self.weight, self.bias)
    return original_forward(self, x, *args, **kwargs)


def install(model: nn.Module) -> int:
    """Route every plain ``nn.Linear`` of ``model`` through the decode kernel; returns how many
    layers it routed now (idempotent; ``patching.peft_lora.restore_forward`` undoes one). With
    bf16 / fp16 weights on CPU the kernel is chosen here, so a first-use build of the C++
    extension happens while the model loads, not at the first generated token."""
    count, low_precision_cpu = 0, False
    for module in model.modules():
        if type(module) is nn.Linear:
            weight = module.weight
            low_precision_cpu |= weight.device.type == "cpu" and weight.dtype in op.LOW_PRECISION
            if not is_installed(module):
                install_forward(module, _forward, None)
                count += 1
    if low_precision_cpu and op.MAX_ROWS > 0:
        backends.select_cpu("decode_linear")
    return count
