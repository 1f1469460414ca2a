"""The decode engine: generation for chat, infer, serve, eval and GRPO rollouts on CPU.

:class:`DecodeEngine` (engine.py) runs a dense Llama-family model's decoding steps in one C++
call per step for any set of sequences (continuous batching), with its frozen weights in a
decode format (as stored, bf16, int8 or q4: ``ops/quant_linear.py``) and its PEFT adapters
unmerged per row (adapters.py); families.py says which models it runs and why not the others,
which generate through their own forward.
"""

from lorafuse.decode.adapters import active_adapter
from lorafuse.decode.engine import (
    WEIGHTS,
    DecodeEngine,
    EngineUnavailable,
    Sequence,
    engine_for,
    unavailable_reason,
)

__all__ = ["WEIGHTS", "DecodeEngine", "EngineUnavailable", "Sequence", "active_adapter",
           "engine_for", "unavailable_reason"]  # fmt: skip
