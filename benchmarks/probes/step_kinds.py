"""Question: where does one lorafuse training step of a bench model spend its time, by kind of
work (the head's GEMMs, the loss kernel, each mixer kernel, frozen GEMMs, LoRA, glue)?
Answer: on the Qwen3.5-0.8B shape (4 layers, 1 x 256, bf16, 1 thread, AMX Xeon under load) the
248320-token head's GEMMs ~0.5-0.6 CPU s of a ~1.3 s step, Gated DeltaNet backward ~0.2, its
forward ~0.1 (docs/benchmarks.md has the table for both models and dtypes).
Constant: none (informs ``ops.cross_entropy.WIDE_ROWS`` and the next kernel to work on).

Builds the model as ``lorafuse bench`` does (random weights, LoRA on every Linear, patched),
times one step on this process's CPU clock, then profiles another with torch.profiler and groups
the self time by kind. Under load the profiled wall time is inflated, so each kind's share is
also given scaled to the unprofiled step's CPU seconds (approximate).

    python benchmarks/probes/step_kinds.py qwen3.5-0.8b:bf16 qwen3-0.8b-dense:bf16
"""

from __future__ import annotations

import collections
import functools
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lorafuse.bench.llm import adamw, token_batches, train_step
from lorafuse.bench.model import build_model
from lorafuse.testing.timing import median_time

HEAD = "248320"  # the vocabulary of the qwen3.5 / dense bench models: the head's GEMMs


def kind(key: str, shapes: str) -> str:
    rules = (
        (key.startswith("lorafuse::gated_delta_forward"), "gated delta fwd"),
        (key.startswith("lorafuse::gated_delta_backward"), "gated delta bwd"),
        (key.startswith("lorafuse::causal_conv1d"), "short conv fwd+bwd"),
        (key.startswith(("lorafuse::attention", "aten::_scaled_dot")), "attention kernel"),
        (key in ("aten::mm", "aten::addmm") and HEAD in shapes, "loss: lm_head GEMMs"),
        (key.startswith("lorafuse::cross_entropy") or "CrossEntropy" in key, "loss: kernel + glue"),
        (key in ("aten::mm", "aten::addmm", "aten::bmm"), "frozen GEMMs"),
        (key.startswith("lorafuse::lora_rank"), "LoRA rank-r products"),
        ("rms_norm" in key or "RMSNorm" in key, "norms"),
        ("swiglu" in key, "SwiGLU"),
        ("adam" in key.lower() or key.startswith("Optimizer"), "optimizer"),
    )
    return next((name for hit, name in rules if hit), "glue (casts, copies, autograd, Python)")


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    for model_name, dtype in (a.split(":") for a in argv):
        spec = dict(model=model_name, dtype=dtype, device="cpu", layers=4, batch=1, seq=256,
                    rank=16, config="lorafuse", backend="auto", grad_ckpt=False, threads=1)  # fmt: skip
        model = build_model(spec)
        opt = adamw([p for p in model.parameters() if p.requires_grad])
        batches = token_batches(spec, 4)
        step = functools.partial(train_step, model, opt, batches[2])
        cpu = median_time(step, 1, 2, time.process_time)  # after two warm-up steps
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            train_step(model, opt, batches[3])
        seconds: dict[str, float] = collections.defaultdict(float)
        for row in prof.key_averages(group_by_input_shape=True):
            seconds[kind(row.key, str(row.input_shapes))] += row.self_cpu_time_total / 1e6
        total = sum(seconds.values())
        print(f"## {model_name} {dtype}: step {cpu:.3f} CPU s unprofiled; profiled {total:.3f} s")
        for name, s in sorted(seconds.items(), key=lambda x: -x[1]):
            print(f"  {name:40s} {s:7.3f} s {s / total:6.1%}  ~{cpu * s / total:.3f} CPU s")
        del model, opt, step
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["qwen3.5-0.8b:bf16", "qwen3-0.8b-dense:bf16"]))
