"""int8 frozen products (``load_in_int8``) against the dense products they replace, at the
SmolLM2-135M projection shapes: per projection the forward ``x·Wᵀ`` and the input gradient
``g·W`` of ``--tokens`` rows, in bf16 (torch's GEMM: oneDNN / AMX where present) and fp32, and
in int8 (``csrc/int8_linear.cpp``: the row quantization, oneDNN's int8 micro-kernel on the
packed weight, the rescale; everything the fused ops call). The two directions are timed
together, as a training step runs them. The torch reference of the int8 op (a float64 product)
is the test oracle, not a contender, so it is not timed. ratio = dense / int8 (> 1: int8 faster).

    python benchmarks/ops/int8_linear.py [--tokens 96,2048] [--threads 1] [--repeats 9]
        [--clock cpu] [--json out.json]

``--clock cpu`` times this process's CPU seconds (with ``--threads 1`` on a shared machine: the
work itself). These numbers decide whether ``int8_linear`` is in ``backends.CPP_DEFAULT``.
"""

from __future__ import annotations

import argparse
import time

import torch

from lorafuse import backends
from lorafuse.files import write_json
from lorafuse.ops import int8_linear
from lorafuse.testing.timing import interleaved_medians

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)}


def bench(shape, tokens: int, repeats: int, clock) -> dict:
    out, n_in = shape
    w = torch.randn(shape) * 0.02
    x, g = torch.randn(tokens, n_in), torch.randn(tokens, out)
    packed = int8_linear.pack(w, backend="cpp")
    wb, xb, gb = w.bfloat16(), x.bfloat16(), g.bfloat16()
    fns = {
        "fp32": lambda: (x @ w.t(), g @ w),
        "bf16": lambda: (xb @ wb.t(), gb @ wb),
        "int8 (fp32 rows)": lambda: (
            int8_linear.linear(x, packed, shape),
            int8_linear.input_grad(g, packed, shape),
        ),
        "int8 (bf16 rows)": lambda: (
            int8_linear.linear(xb, packed, shape),
            int8_linear.input_grad(gb, packed, shape),
        ),
    }
    t = interleaved_medians(fns, repeats, warmup=2, clock=clock, rotate=True)
    gflop = 2 * 2 * tokens * out * n_in / 1e9
    return {name: {"s": s, "gflops": gflop / s} for name, s in t.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="96,2048")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not int8_linear.available():
        raise SystemExit("no int8 kernel here (needs AMX-INT8 or AVX-512-VNNI and the C++ build)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"C++ {backends.cpp_variant()}, {torch.get_num_threads()} threads, clock {args.clock}; "
          "GFLOP/s of forward + input gradient; ratio = bf16 / int8")  # fmt: skip
    results = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, shape in SHAPES.items():
            r = results[f"{tokens} {name}"] = bench(shape, tokens, args.repeats, clock)
            cells = "  ".join(f"{k} {v['gflops']:7.1f}" for k, v in r.items())
            ratio = r["bf16"]["s"] / r["int8 (bf16 rows)"]["s"]
            print(f"{tokens:5d} x {name:8s} {cells}  bf16/int8 {ratio:.2f}x")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
