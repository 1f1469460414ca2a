"""What the ``lorafuse::`` custom ops share, so ``torch.compile`` traces the fused ops.

Each op registers its own custom ops (fake implementation + autograd formula whose backward is a
custom op) at the end of its file, around the kernels its ``autograd.Function`` calls; they run
inside ``torch.compile`` only (:func:`active`). This module holds what they share and imports no
op. What stays outside the ops and what is not covered: docs/kernels.md and docs/compile.md.
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
