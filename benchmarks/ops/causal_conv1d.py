"""Causal depthwise conv1d + SiLU on CPU: transformers' torch functions against ours (torch, C++).

Shapes like Qwen3.5-0.8B's linear-attention conv (channels 2·Hk·Dk + Hv·Dv = 6144 with 16 heads
of 128, kernel 4, SiLU, no bias) at 1 x 512, 1 x 2048 and 4 x 512 tokens, x as the model
hands it over (in_proj's output transposed: channels adjacent in memory). Timed: forward alone and
forward + backward (dx and dweight), interleaved with rotation (``lorafuse.testing.timing``),
medians of ``--repeats``; ratio = transformers / ours. ``hf`` is ``causal_conv1d_fn``
(``F.conv1d`` and its autograd); the decoding step (one token a row with the K - 1 state) compares
``causal_conv1d_update`` with ours.

    python benchmarks/ops/causal_conv1d.py [--threads 2] [--repeats 9] [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from lorafuse import backends
from lorafuse.ops.causal_conv1d import causal_conv1d
from lorafuse.testing.timing import (
    add_clock_arguments,
    clock_from_args,
    cpu_name,
    interleaved_medians,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = [(1, 512, 6144), (1, 2048, 6144), (4, 512, 6144)]  # (B, T, D)
K = 4


def convs():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    found = {"hf": lambda x, w: causal_conv1d_fn(x, w, None, activation="silu")}
    for backend in ["torch"] + (["cpp"] if backends.cpp_available() else []):
        found[backend] = lambda x, w, b=backend: causal_conv1d(x, w, activation="silu", backend=b)[
            0
        ]
    return found


def steps():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    found = {"hf": lambda x, w, s: causal_conv1d_update(x, s, w, None, activation="silu")}
    for backend in ["torch"] + (["cpp"] if backends.cpp_available() else []):
        found[backend] = lambda x, w, s, b=backend: causal_conv1d(
            x, w, activation="silu", initial_state=s[..., 1:], output_final_state=True, backend=b
        )  # fmt: skip
    return found


def bench(shape, dtype, repeats, warmup, clock):
    b, t, d = shape
    gen = torch.Generator().manual_seed(0)
    x = (
        torch.randn(b, t, d, generator=gen).to(dtype).transpose(1, 2)
    )  # (B, D, T), channels adjacent
    w = (torch.randn(d, K, generator=gen) * 0.5).to(dtype)
    dy = torch.randn(b, t, d, generator=gen).to(dtype).transpose(1, 2)
    found = convs()
    with torch.no_grad():
        ref = found["hf"](x, w).float()
        for name, fn in found.items():
            err = (fn(x, w).float() - ref).abs().max().item() / ref.abs().max().item()
            assert err < (1e-5 if dtype == torch.float32 else 1e-2), (name, err)  # a few roundings
    with torch.no_grad():
        fwd = interleaved_medians({n: (lambda f=f: f(x, w)) for n, f in found.items()}, repeats,
                                  warmup, rotate=True, clock=clock)  # fmt: skip

    def both(f):
        def run():
            xl, wl = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            torch.autograd.grad(f(xl, wl), (xl, wl), dy)

        return run

    return fwd, interleaved_medians({n: both(f) for n, f in found.items()}, repeats, warmup,
                                    rotate=True, clock=clock)  # fmt: skip


def bench_step(b, d, dtype, repeats, warmup, clock):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, d, 1, generator=gen).to(dtype)
    w = torch.randn(d, K, generator=gen).to(dtype)
    state = torch.randn(b, d, K, generator=gen).to(dtype)  # transformers' conv state: K columns
    fns = {n: (lambda f=f: f(x, w, state.clone())) for n, f in steps().items()}
    with torch.no_grad():
        return interleaved_medians(fns, repeats * 10, warmup, rotate=True, clock=clock)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_clock_arguments(p)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--shapes", nargs="*", default=None,
                   help="B,T,D triples (default: SHAPES; none: the decoding step alone)")  # fmt: skip
    args = p.parse_args(argv)
    clock = clock_from_args(p, args)
    print(f"CPU: {cpu_name()}; {args.threads} threads, {args.clock} clock; torch {torch.__version__}; "
          f"load average {os.getloadavg()}; K={K}, SiLU, no bias")  # fmt: skip
    names = list(convs())
    print(f"{'B,T,D':<14}{'dtype':<6}{'pass':<9}" + "".join(f"{n + ' ms':>11}" for n in names)
          + "".join(f"{'hf/' + n:>9}" for n in names[1:]))  # fmt: skip
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        rows = []
        shapes = (
            SHAPES if args.shapes is None else [tuple(map(int, x.split(","))) for x in args.shapes]
        )
        for shape in shapes:
            fwd, both = bench(shape, dtype, args.repeats, args.warmup, clock)
            rows += [(",".join(map(str, shape)), "fwd", fwd), ("", "fwd+bwd", both)]
        for b in (1, 4):
            rows.append((f"{b},1,6144", "decode", bench_step(b, 6144, dtype, args.repeats,
                                                             args.warmup, clock)))  # fmt: skip
        for label, pass_, t in rows:
            cells = "".join(f"{1e3 * t[n]:>11.3f}" for n in names)
            ratios = "".join(f"{t['hf'] / t[n]:>9.2f}" for n in names[1:])
            print(f"{label:<14}{dtype_name:<6}{pass_:<9}{cells}{ratios}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
