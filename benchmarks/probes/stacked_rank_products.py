"""Question: should projections sharing an input run their rank-r A products stacked?
Answer: q/k/v yes (1.05-1.46x bf16, 0.98-1.16x fp32); gate/up only with fp32 adapters on a bf16
base (median 1.10x; fp32 1.04x, bf16 0.99x) (N=2048, r=16, 2-core AMX Xeon).
Constant: ``ops.lora_projection.stackable`` and ``ops.lora_mlp.stack_gate_up`` (src/lorafuse/ops/).

Stacked vs per-projection rank-r A products in the fused Q/K/V and MLP ops, forward + backward.

The fused ops run projections that share their input x either with one ``lora_linear`` kernel
per projection (x read, and cast to the adapter dtype, once per projection; one (N, d) LoRA term
per projection added into dx) or stacked (``x·[A_q; A_k; A_v]ᵀ`` once, ``dx += gB·[A_q; A_k;
A_v]`` once, ``d[A] = gBᵀ·x`` once; see ``lorafuse.ops.lora_projection.stackable``). This times
both through the ops' autograd Functions, interleaved, at the shapes of SmolLM2-135M and the
4-layer hidden-1024 Llama (r = 16, N = 2048 tokens), for fp32, bf16 with fp32 adapters (PEFT's
default: ``autocast_adapter_dtype``) and bf16 adapters. ratio = per-projection / stacked
(> 1: stacking is faster). These numbers decide ``stackable``.

    python benchmarks/probes/stacked_rank_products.py [--quick] [--repeats 7] [--json out.json]
    python benchmarks/probes/stacked_rank_products.py --threads 1 --cpu-time   # on a busy shared box
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from lorafuse import backends
from lorafuse.files import write_json
from lorafuse.ops.lora_mlp import LoRAMLPFunction
from lorafuse.ops.lora_params import LoRAParams
from lorafuse.ops.lora_projection import flatten, meta_of
from lorafuse.ops.lora_qkv import LoRAQKVFunction
from lorafuse.testing.timing import interleaved_medians

# name -> (d, q out, k/v out, intermediate)
MODELS = {"smollm2-135m": (576, 576, 192, 1536), "llama-4l-1024": (1024, 1024, 1024, 2816)}
# (label, base dtype, adapter dtype)
DTYPES = [
    ("fp32", torch.float32, torch.float32),
    ("bf16+fp32 A/B", torch.bfloat16, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16),
]


def _proj(d_in, d_out, r, dtype, adapter):
    w = (torch.randn(d_out, d_in) / d_in**0.5).to(dtype)
    A = (torch.randn(r, d_in) / d_in**0.5).to(adapter).requires_grad_(True)
    B = (torch.randn(d_out, r) / r**0.5).to(adapter).requires_grad_(True)
    return LoRAParams(w, None, A, B, 2.0, 0.0)


def qkv_case(N, d, oq, okv, r, dtype, adapter, backend):
    """Two closures (per-projection, stacked), each one forward + backward of ``lora_qkv``."""
    x = torch.randn(N, d).to(dtype).requires_grad_(True)
    params = [_proj(d, o, r, dtype, adapter) for o in (oq, okv, okv)]
    gs = [torch.randn(N, o).to(dtype) for o in (oq, okv, okv)]
    leaves = [x] + [t for p in params for t in (p.lora_A, p.lora_B)]

    def run(stacked):
        outs = LoRAQKVFunction.apply(x, *flatten(params), meta_of(params), backend, stacked)
        torch.autograd.grad(outs, leaves, gs)

    return lambda: run(False), lambda: run(True)


def mlp_case(N, d, inter, r, dtype, adapter, backend):
    """Two closures (gate/up per projection, stacked), one forward + backward of ``lora_mlp``."""
    x = torch.randn(N, d).to(dtype).requires_grad_(True)
    params = [_proj(d, inter, r, dtype, adapter) for _ in range(2)]
    params.append(_proj(inter, d, r, dtype, adapter))
    g = torch.randn(N, d).to(dtype)
    leaves = [x] + [t for p in params for t in (p.lora_A, p.lora_B)]

    def run(stacked):
        args = (*flatten(params), meta_of(params), backend, backend, "silu", stacked)
        torch.autograd.grad(LoRAMLPFunction.apply(x, *args), leaves, g)

    return lambda: run(False), lambda: run(True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--backend", default="auto", help="lora_linear backend (default: auto)")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time CPU seconds of this process (use with --threads 1 on a busy box)",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    backend = backends.select("lora_linear", torch.device("cpu"), args.backend)
    N = 64 if args.quick else args.tokens
    print(f"backend {backend}, N={N}, r={args.rank}, threads {args.threads}, "
          f"{'CPU' if args.cpu_time else 'wall'} time, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'model':<15}{'op':<6}{'dtype':<15}{'per-proj ms':>12}{'stacked ms':>12}{'ratio':>8}")
    rows = []
    for model, (d, oq, okv, inter) in MODELS.items():
        if args.quick:
            d, oq, okv, inter = d // 8, oq // 8, okv // 8, inter // 8
        for label, dt, at in DTYPES:
            for op in ("qkv", "mlp"):
                torch.manual_seed(0)
                if op == "qkv":
                    fns = qkv_case(N, d, oq, okv, args.rank, dt, at, backend)
                else:
                    fns = mlp_case(N, d, inter, args.rank, dt, at, backend)
                clock = time.process_time if args.cpu_time else time.perf_counter
                per, st = fns
                t = interleaved_medians(
                    {"per": per, "stacked": st}, args.repeats, args.warmup, clock
                )
                t_per, t_st = t["per"], t["stacked"]
                row = dict(model=model, op=op, dtype=label, per_projection_ms=1e3 * t_per,
                           stacked_ms=1e3 * t_st, ratio=t_per / t_st)  # fmt: skip
                rows.append(row)
                print(f"{model:<15}{op:<6}{label:<15}{1e3 * t_per:>12.2f}{1e3 * t_st:>12.2f}"
                      f"{t_per / t_st:>8.3f}", flush=True)  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f}")
    if args.json:
        meta = dict(backend=backend, tokens=N, rank=args.rank, threads=args.threads,
                    repeats=args.repeats, cpu_time=args.cpu_time, torch=torch.__version__, load=os.getloadavg())  # fmt: skip
        write_json(args.json, dict(meta=meta, rows=rows))  # atomic
    return 0


if __name__ == "__main__":
    sys.exit(main())
