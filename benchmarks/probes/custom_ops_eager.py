"""Question: should eager calls route through the ``lorafuse::`` custom ops too?
Answer: no: 1.75-1.91x slower at small shapes, 1.40x on a tiny Llama step, 0.95-0.97x at large
ones (1 thread; the CPU is not recorded, docs/compile.md).
Constant: ``ops.custom_ops.active`` (src/lorafuse/ops/custom_ops.py: only while Dynamo traces).

Eager cost of the custom ops: each op's ``autograd.Function`` vs the same op routed through its
``lorafuse::`` custom op (``custom_ops.active`` forced True), forward + backward.

This decides whether eager goes through the custom ops too (docs/compile.md): it does not, since
the dispatcher's per-call cost shows at small shapes and on whole small-model steps.

    python benchmarks/probes/custom_ops_eager.py

One torch thread; median of 5 timings of ``n`` calls each after 3 warmup calls.
"""

from __future__ import annotations

import peft
import torch
import transformers as tf

from lorafuse import patch_peft_model
from lorafuse.ops import custom_ops
from lorafuse.ops.lora_linear import lora_linear
from lorafuse.ops.rms_norm import rms_norm
from lorafuse.testing import LORA_TARGETS, tiny_llama_config
from lorafuse.testing.timing import median_time


def _time(fn, n: int) -> float:
    return median_time(fn, 5, warmup=3, number=n)


def _both(fn, n: int) -> tuple[float, float]:
    """(Function path, custom-op path) seconds per call."""
    real = custom_ops.active
    try:
        custom_ops.active = lambda: False
        a = _time(fn, n)
        custom_ops.active = lambda: True
        b = _time(fn, n)
    finally:
        custom_ops.active = real
    return a, b


def _line(name: str, a: float, b: float) -> None:
    print(f"{name:48s} function {a * 1e3:9.3f} ms  custom op {b * 1e3:9.3f} ms  ratio {b / a:.2f}")


def _ops(N: int, d: int, r: int) -> None:
    x = torch.randn(N, d, requires_grad=True)
    W = torch.randn(d, d)
    A, B = torch.randn(r, d, requires_grad=True), torch.randn(d, r, requires_grad=True)
    w = torch.randn(d, requires_grad=True)
    n = 200 if N < 512 else 10
    _line(f"lora_linear N={N} d=k={d} r={r}",
          *_both(lambda: lora_linear(x, W, None, A, B, 2.0).sum().backward(), n))  # fmt: skip
    _line(f"rms_norm N={N} d={d}", *_both(lambda: rms_norm(x, w).sum().backward(), n))


def _model(name: str, cfg, n: int) -> None:
    lora = peft.LoraConfig(r=8, target_modules=LORA_TARGETS)
    model = patch_peft_model(peft.get_peft_model(tf.LlamaForCausalLM(cfg), lora)).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 128))
    step = lambda: model(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
    _line(f"model step {name}, 2 x 128 tokens", *_both(step, n))


def main() -> None:
    torch.set_num_threads(1)
    for N, d, r in ((32, 64, 8), (512, 512, 16), (2048, 1024, 16)):
        _ops(N, d, r)
    torch.manual_seed(0)
    _model("tiny", tiny_llama_config(), 10)
    big = tiny_llama_config(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=8, vocab_size=8000)  # fmt: skip
    _model("4 layers, hidden 512", big, 2)


if __name__ == "__main__":
    main()
