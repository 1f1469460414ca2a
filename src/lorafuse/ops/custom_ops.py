"""What the ``lorafuse::`` custom ops share, so ``torch.compile`` traces the fused ops.

A plain ``autograd.Function`` around a C++ (pybind) or Triton kernel is opaque to Dynamo: every
call is a graph break. Registered with :func:`torch.library.custom_op`, each op is one node of
the compiled graph, with a fake implementation (shapes and dtypes only, for tracing) and an
autograd formula whose backward is itself a custom op, so compiled backward graphs hold no break
either. Each op registers its own custom ops at the end of its file (``lora_linear``, ``dora``,
``rms_norm``, ``rope``, ``swiglu``, ``attention``, ``cross_entropy``), around the same kernels its
``autograd.Function`` calls; this module holds only what they share and imports no op.

Outside every op, in traceable Python at the entry points: backend selection
(:func:`lorafuse.backends.select`, constant for a compiled graph: changing ``LORAFUSE_KERNELS``
after the first compiled call does not recompile), autocast casts, the dropout
mask draw (``bernoulli_``; under Inductor it uses Inductor's RNG, so masks differ from eager's
draws while the distribution is the same), flattening and input checks.

When the custom ops run: inside ``torch.compile`` only (:func:`active`); eager keeps the
``autograd.Function`` of each op file, which saves less (e.g. ``lora_qkv``/``lora_mlp`` are one
node there) and measured faster on small shapes (docs/compile.md). Under compile ``lora_qkv`` and
``lora_mlp`` are composed from ``lora_linear``/``swiglu`` nodes: ``x`` is still saved once (one
tensor), but the MLP keeps ``h = silu(gate)*up`` (N, I) for the down projection's backward
instead of recomputing it.

Not covered: quantized base weights (NF4) stay on the eager ``autograd.Function`` path; under
compile they are dequantized outside the op (so the dense copy is saved for backward) and that
path is not tested under compile. Double backward is not supported (the backward ops have no
autograd of their own).
"""

import torch
from torch import Tensor

from lorafuse import backends, hardware

# Backend selection is Python with caches, locks (the C++ build) and a record of each choice:
# Dynamo cannot trace it, and its answer depends only on the op, the device, the request and
# the environment, never on tensor values. Marked constant, it runs once while a graph is traced
# (recording its choice as in eager) and the compiled graph holds the answer.
torch.compiler.assume_constant_result(backends.select)
# Likewise whether bf16/fp16 products are native here (env var and /proc/cpuinfo: the attention
# length rule and the fused loss ask it under autocast).
torch.compiler.assume_constant_result(hardware.native_low_precision_matmul)


def active() -> bool:
    """Whether the entry points route through the custom ops: while ``torch.compile`` traces."""
    return torch.compiler.is_compiling()


def grad_or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """Custom ops cannot return None: a gradient nobody asked for comes back as a 0-size tensor."""
    return like.new_empty(0) if t is None else t
