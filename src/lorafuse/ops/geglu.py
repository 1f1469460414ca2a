"""GeGLU activation with GELU's tanh approximation: ``h = gelu_tanh(gate) * up`` (Gemma's MLP,
``ACT2FN["gelu_pytorch_tanh"]``), the activation :func:`lorafuse.ops.lora_mlp.lora_mlp` runs with
``activation="gelu_tanh"``.

Shapes (after flattening the leading dims): gate (N, I), up (N, I), h (N, I).

* The same contract as :mod:`lorafuse.ops.swiglu`'s kernels: forward in fp32 with one rounding
  to the output dtype (HF's ``act_fn(gate) * up`` rounds twice in bf16); backward recomputes
  ``gelu_tanh(gate)`` and its derivative (``aten.gelu_backward``, the one autograd uses), with
  dgate optionally written into the incoming gradient's buffer. Nothing (N, I) is stored by it:
  the fused MLP saves gate and up and recomputes h.
* Backends: ``torch`` only (no C++ / Triton GeGLU kernel yet); the MLP's LoRA projections use
  the selected backend's kernels all the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain autograd math, as ``Gemma3MLP`` computes it."""
    return F.gelu(gate, approximate="tanh") * up


def geglu_forward(gate, up):
    """``h (N, I)`` in gate's dtype, computed in fp32."""
    return (F.gelu(gate.to(torch.float32), approximate="tanh") * up.to(torch.float32)).to(
        gate.dtype
    )


def geglu_backward(g, gate, up, dgate_into_g=False):
    """``(dgate, dup)`` (N, I) in gate's / up's dtype (see swiglu's ``_torch_backward``)."""
    z = gate.to(torch.float32)
    g32 = g.to(torch.float32)
    dup = (g32 * F.gelu(z, approximate="tanh")).to(up.dtype)
    dgate = torch.ops.aten.gelu_backward(g32 * up.to(torch.float32), z, approximate="tanh")
    if dgate_into_g and g.dtype == gate.dtype:
        return g.copy_(dgate), dup
    return dgate.to(gate.dtype), dup
