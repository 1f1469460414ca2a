"""Gated DeltaNet's chunked rule on CPU: transformers' torch function against ours (torch and C++).

Shapes like Qwen3.5-0.8B's linear-attention layers (16 value heads, 16 or 8 key heads, head dims
128; q, k, v as the model hands them over, L2-normalised in the op, g <= 0 in fp32, beta in
(0, 1)), at T = 512 and 2048 tokens and batches 1-4. Timed: the forward alone (no gradient) and
forward + backward (every input's gradient), interleaved with rotation
(``lorafuse.testing.timing``), medians of ``--repeats``; ratio = transformers / ours. ``hf`` is
``torch_chunk_gated_delta_rule`` (its own autograd for the backward); ``torch`` and ``cpp`` our
``gated_delta_rule`` with those backends. The decoding step (T = 1 with a state) compares
``torch_recurrent_gated_delta_rule`` with ours.

To put the mixer in its layer, the same run times the layer's matrix products at the same token
count and dtype: forward and the input gradient (frozen base weights, as in LoRA training) of
in_proj_qkv (hidden -> 2·Hk·Dk + Hv·Dv), in_proj_z (hidden -> Hv·Dv), in_proj_a/b (hidden -> Hv),
out_proj (Hv·Dv -> hidden) and the MLP (gate/up hidden -> I, down I -> hidden), with hidden 1024
and I 3584 (``--hidden``, ``--intermediate``): ``gdn/products`` is the rule's fwd+bwd over them.

    python benchmarks/ops/gated_delta.py [--threads 2] [--repeats 5] [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from lorafuse import backends
from lorafuse.ops.gated_delta import gated_delta_rule
from lorafuse.testing.timing import (
    add_clock_arguments,
    clock_from_args,
    cpu_name,
    interleaved_medians,
)

# (B, T, Hk): Hv = 16, Dk = Dv = 128
SHAPES = [(1, 512, 16), (1, 2048, 16), (1, 2048, 8), (4, 512, 16), (4, 512, 8)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HV, D = 16, 128


def inputs(b, t, hk, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, D, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(b, t, HV, D, generator=gen).to(dtype)
    g = -torch.rand(b, t, HV, generator=gen) * 0.5  # fp32, as the model computes it
    beta = torch.rand(b, t, HV, generator=gen).to(dtype)
    return q, k, v, g, beta


def rules():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    found = {"hf": lambda *a: torch_chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True)[0]}
    for backend in ["torch"] + (["cpp"] if backends.cpp_available() else []):
        found[backend] = lambda *a, b=backend: gated_delta_rule(*a, backend=b)[0]
    return found


def step_rules():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    found = {"hf": lambda *a, s: torch_recurrent_gated_delta_rule(
        *a, initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=True)}  # fmt: skip
    for backend in ["torch"] + (["cpp"] if backends.cpp_available() else []):
        found[backend] = lambda *a, s, b=backend: gated_delta_rule(
            *a, initial_state=s, output_final_state=True, backend=b)  # fmt: skip
    return found


def fwd_bwd(fn, args, do):
    def run():
        leaves = [a.detach().requires_grad_(True) for a in args]
        torch.autograd.grad(fn(*leaves), leaves, do)

    return run


def products(n_tokens, hk, dtype, hidden, inter):
    """fwd + input-gradient of the layer's projections at n_tokens (one callable) and of the MLP."""
    gen = torch.Generator().manual_seed(1)
    mixer = [(hidden, 2 * hk * D + HV * D), (hidden, HV * D), (hidden, HV), (hidden, HV),
             (HV * D, hidden)]  # fmt: skip
    mlp = [(hidden, inter), (hidden, inter), (inter, hidden)]

    def make(pairs):
        ws = [torch.randn(o, i, generator=gen).to(dtype) * 0.02 for i, o in pairs]
        xs = [torch.randn(n_tokens, i, generator=gen).to(dtype) for i, _ in pairs]
        gs = [torch.randn(n_tokens, o, generator=gen).to(dtype) for _, o in pairs]

        def run():
            for w, x, g in zip(ws, xs, gs):
                torch.nn.functional.linear(x, w)  # forward
                g @ w  # dx (frozen weight: no dW)

        return run

    return make(mixer), make(mlp)


def bench(shape, dtype, repeats, warmup, hidden, inter, clock):
    b, t, hk = shape
    args = inputs(b, t, hk, dtype)
    found = rules()
    do = torch.randn(b, t, HV, D).to(dtype)
    with torch.no_grad():
        ref = found["hf"](*args).float()
        for name, fn in found.items():  # every implementation agrees before it is timed
            err = (fn(*args).float() - ref).abs().max().item() / ref.abs().max().item()
            assert err < (1e-4 if dtype == torch.float32 else 1e-2), (name, err)  # roundings
    fwd = {n: (lambda f=f: f(*args)) for n, f in found.items()}
    with torch.no_grad():
        fwd_t = interleaved_medians(fwd, repeats, warmup, rotate=True, clock=clock)
    both = {n: fwd_bwd(f, args, do) for n, f in found.items()}
    mixer, mlp = products(b * t, hk, dtype, hidden, inter)
    both |= {"mixer products": mixer, "mlp products": mlp}
    both_t = interleaved_medians(both, repeats, warmup, rotate=True, clock=clock)
    return fwd_t, both_t


def bench_step(b, hk, dtype, repeats, warmup, clock):
    q, k, v, g, beta = inputs(b, 1, hk, dtype, seed=2)
    state = torch.randn(b, HV, D, D) * 0.1
    fns = {n: (lambda f=f: f(q, k, v, g, beta, s=state)) for n, f in step_rules().items()}
    with torch.no_grad():
        return interleaved_medians(fns, repeats * 10, warmup, rotate=True, clock=clock)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_clock_arguments(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--shapes", nargs="*", default=None,
                   help="B,T,Hk triples (default: SHAPES; none: the decoding step alone)")  # fmt: skip
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3584)
    args = p.parse_args(argv)
    clock = clock_from_args(p, args)
    shapes = SHAPES if args.shapes is None else [tuple(map(int, s.split(","))) for s in args.shapes]
    print(f"CPU: {cpu_name()}; {args.threads} threads, {args.clock} clock; torch {torch.__version__}; "
          f"load average {os.getloadavg()}")  # fmt: skip
    print(f"Hv={HV} Dk=Dv={D}; layer products: hidden {args.hidden}, MLP {args.intermediate}")
    names = list(rules())
    head = "".join(f"{n + ' ms':>11}" for n in names)
    print(f"{'B,T,Hk':<13}{'dtype':<6}{'pass':<9}{head}" + "".join(
        f"{'hf/' + n:>9}" for n in names[1:]) + f"{'products ms':>13}{'gdn/prod':>9}")  # fmt: skip
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for shape in shapes:
            fwd_t, both_t = bench(shape, dtype, args.repeats, args.warmup, args.hidden,
                                  args.intermediate, clock)  # fmt: skip
            prods = both_t["mixer products"] + both_t["mlp products"]
            for pass_, t in (("fwd", fwd_t), ("fwd+bwd", both_t)):
                cells = "".join(f"{1e3 * t[n]:>11.2f}" for n in names)
                ratios = "".join(f"{t['hf'] / t[n]:>9.2f}" for n in names[1:])
                tail = ""
                if pass_ == "fwd+bwd":
                    best = min(t[n] for n in names[1:])
                    tail = f"{1e3 * prods:>13.2f}{best / prods:>9.2f}"
                print(f"{','.join(map(str, shape)):<13}{dtype_name:<6}{pass_:<9}{cells}{ratios}"
                      f"{tail}", flush=True)  # fmt: skip
        for b in (1, 4):
            t = bench_step(b, 16, dtype, args.repeats, args.warmup, clock)
            cells = "".join(f"{1e3 * t[n]:>11.3f}" for n in names)
            ratios = "".join(f"{t['hf'] / t[n]:>9.2f}" for n in names[1:])
            print(f"{f'{b},1,16':<13}{dtype_name:<6}{'decode':<9}{cells}{ratios}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
