"""Rank-r LoRA products (``csrc/lora_rank.cpp``: FMA kernels, bf16x3) vs the plain tensor expressions.

With fp32 adapters on a bf16 base (PEFT's default), the tensor expressions of the LoRA branch
form full-size fp32 tensors (``x.to(fp32)``, ``xa·Bᵀ`` before it is added into y, ``g.to(fp32)``,
``gB·A`` before it is added into dx); the C++ products never form them. This
times, interleaved, at SmolLM2-135M's and the 4-layer hidden-1024 Llama's shapes (N tokens,
rank 16, bf16 base, fp32 adapters):

* each product alone: ``lora_rank.TORCH_RANK_OPS`` (the reference, what the stacked path ran
  before) vs the C++ ones, on the gate/up width;
* the fused MLP and Q/K/V (gate/up and q/k/v stacked), forward + backward, with the rank-r
  products of the stacked path from torch vs C++ (everything else the same C++ kernels).

ratio = torch / cpp (> 1: the C++ products are faster). The C++ products run as register-blocked
fp32 FMA kernels, or, where bf16 products are several times faster than fp32 (AMX), as bf16x3
GEMMs for a bf16 large operand (``lora_rank.cpp`` says which, per product). ``--baseline``
compares them, in the same process, interleaved, with other C++ settings instead of torch
(ratio = baseline / cpp):

* ``old``: the FMA kernels off (bf16x3 where it applies, else the fp32 tiles: before them);
* ``tiles``: the fp32 tiles everywhere (FMA kernels and bf16x3 off);
* ``fma``: bf16x3 off (the FMA kernels where bf16x3 would run);
* ``bf16x3``: bf16x3 wherever bf16 is native and MKL's bf16 GEMM is there (by default only on
  AMX: ``csrc/lora_rank_bf16x3.cpp`` says why).

``--widths 1536 576`` times only the five products, each at every width (d = k = width).

    python benchmarks/ops/lora_rank.py [--quick] [--repeats 7] [--json out.json]
    python benchmarks/ops/lora_rank.py --threads 1 --cpu-time   # on a busy shared box
    python benchmarks/ops/lora_rank.py --threads 1 --cpu-time --baseline old --widths 1536 576
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from lorafuse import _ext, backends
from lorafuse.files import write_json
from lorafuse.ops import lora_rank, lora_split
from lorafuse.ops.lora_mlp import LoRAMLPFunction
from lorafuse.ops.lora_params import LoRAParams
from lorafuse.ops.lora_projection import flatten, meta_of
from lorafuse.ops.lora_qkv import LoRAQKVFunction
from lorafuse.testing.timing import interleaved_medians

# name -> (d, q out, k/v out, intermediate)
MODELS = {"smollm2-135m": (576, 576, 192, 1536), "llama-4l-1024": (1024, 1024, 1024, 2816)}


def product_cases(N, d, k, r):
    """name -> (torch closure, cpp closure): each rank-r product alone, bf16 operands."""
    ref, cpp = (
        lora_rank.TORCH_RANK_OPS,
        lora_rank.rank_ops("cpp", torch.float32, torch.bfloat16),
    )
    x = torch.randn(N, d).bfloat16()  # (N, d)
    g = torch.randn(N, k).bfloat16()  # (N, k)
    A, B = torch.randn(r, d) / d**0.5, torch.randn(k, r) / r**0.5  # fp32 adapters
    xa, gB = torch.randn(N, r), torch.randn(N, r)  # (N, r) fp32
    y, dx = torch.randn(N, k).bfloat16(), torch.randn(N, d).bfloat16()
    return {
        f"down {N}x{d}": (lambda: ref.down(x, A), lambda: cpp.down(x, A)),
        f"up_add_ {N}x{k}": (
            lambda: ref.up_add_(y, xa, B, 2.0),
            lambda: cpp.up_add_(y, xa, B, 2.0),
        ),
        f"grads {N}x{k}": (
            lambda: ref.grads(g, B, xa, 2.0, True, True),
            lambda: cpp.grads(g, B, xa, 2.0, True, True),
        ),
        f"dA {N}x{d}": (lambda: ref.dA(gB, x), lambda: cpp.dA(gB, x)),
        f"dx_add_ {N}x{d}": (lambda: ref.dx_add_(dx, gB, A), lambda: cpp.dx_add_(dx, gB, A)),
    }


def _proj(d_in, d_out, r):
    w = (torch.randn(d_out, d_in) / d_in**0.5).bfloat16()
    A = (torch.randn(r, d_in) / d_in**0.5).requires_grad_(True)
    B = (torch.randn(d_out, r) / r**0.5).requires_grad_(True)
    return LoRAParams(w, None, A, B, 2.0, 0.0)


def op_cases(N, d, oq, okv, inter, r, with_rank):
    """name -> (torch-rank closure, cpp-rank closure): fused MLP / QKV fwd+bwd, stacked."""
    x = torch.randn(N, d).bfloat16().requires_grad_(True)
    mlp = [_proj(d, inter, r), _proj(d, inter, r), _proj(inter, d, r)]
    qkv = [_proj(d, o, r) for o in (oq, okv, okv)]
    g_mlp = torch.randn(N, d).bfloat16()
    g_qkv = [torch.randn(N, o).bfloat16() for o in (oq, okv, okv)]

    def leaves(ps):
        return [x] + [t for p in ps for t in (p.lora_A, p.lora_B)]

    def run_mlp():
        args = (*flatten(mlp), meta_of(mlp), "cpp", "cpp", "silu", True)
        torch.autograd.grad(LoRAMLPFunction.apply(x, *args), leaves(mlp), g_mlp)

    def run_qkv():
        outs = LoRAQKVFunction.apply(x, *flatten(qkv), meta_of(qkv), "cpp", True)
        torch.autograd.grad(outs, leaves(qkv), g_qkv)

    return {
        "mlp fwd+bwd": tuple(with_rank(run_mlp, use) for use in ("torch", "cpp")),
        "qkv fwd+bwd": tuple(with_rank(run_qkv, use) for use in ("torch", "cpp")),
    }


def with_rank_ops(fn, use: str):
    """``fn`` run with the stacked path's rank-r products taken from ``use`` (torch | cpp)."""
    chosen = lora_split.rank_ops
    torch_ops = lora_rank.TORCH_RANK_OPS

    def run():
        if use == "torch":
            lora_split.rank_ops = lambda *a: torch_ops
        try:
            fn()
        finally:
            lora_split.rank_ops = chosen

    return run


# --baseline -> (bf16x3 mode, FMA kernels allowed); the default is ("auto", True)
BASELINES = {
    "old": ("auto", False), "tiles": ("off", False), "fma": ("off", True), "bf16x3": ("on", True),
}  # fmt: skip


def with_kernels(fn, baseline: str):
    """``fn`` run with the C++ rank-r products set as ``baseline`` says (:data:`BASELINES`)."""
    ext = _ext.load_cpp()
    bf16x3, fma = BASELINES[baseline]

    def run():
        ext.lora_rank_set_bf16x3(bf16x3)
        ext.lora_rank_set_fma(fma)
        try:
            fn()
        finally:
            ext.lora_rank_set_bf16x3("auto")
            ext.lora_rank_set_fma(True)

    return run


def _all_cases(args, N):
    """(model or width label, name -> (torch closure, cpp closure)) for each model or width."""
    if args.widths:
        for w in args.widths:
            torch.manual_seed(0)
            yield f"width {w}", product_cases(N, w, w, args.rank)
        return
    for model, (d, oq, okv, inter) in MODELS.items():
        if args.quick:
            d, oq, okv, inter = d // 8, oq // 8, okv // 8, inter // 8
        torch.manual_seed(0)
        cases = product_cases(N, d, inter, args.rank)
        cases.update(op_cases(N, d, oq, okv, inter, args.rank, with_rank_ops))
        yield model, cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--cpu-time", action="store_true", help="CPU seconds (use with --threads 1)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--baseline", choices=("torch", *BASELINES), default="torch",
                   help="compare the C++ products with the torch ones, or with other C++ kernels: "
                   "old (FMA off), tiles (FMA and bf16x3 off), fma (bf16x3 off)")  # fmt: skip
    p.add_argument("--widths", type=int, nargs="+",
                   help="only the five products, at d = k = each of these widths")  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if backends.select("lora_linear", torch.device("cpu"), "cpp") != "cpp":
        print("C++ extension unavailable: nothing to compare")
        return 1
    N = 64 if args.quick else args.tokens
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"N={N}, r={args.rank}, bf16 base + fp32 adapters, threads {args.threads}, "
          f"{'CPU' if args.cpu_time else 'wall'} time, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"bf16x3 by default (AMX, bf16 native, MKL's bf16 GEMM): {lora_rank.cpp_rank_bf16x3()}")
    base = args.baseline
    print(f"{'model':<15}{'case':<22}{base + ' ms':>10}{'cpp ms':>10}{'ratio':>8}")
    rows = []
    for model, cases in _all_cases(args, N):
        for name, (torch_fn, cpp_fn) in cases.items():
            ref_fn = torch_fn if base == "torch" else with_kernels(cpp_fn, base)
            t = interleaved_medians(
                {"ref": ref_fn, "cpp": cpp_fn}, args.repeats, args.warmup, clock
            )
            t_ref, t_cpp = t["ref"], t["cpp"]
            rows.append(dict(model=model, case=name, baseline=base, base_ms=1e3 * t_ref,
                             cpp_ms=1e3 * t_cpp, ratio=t_ref / t_cpp))  # fmt: skip
            print(f"{model:<15}{name:<22}{1e3 * t_ref:>10.3f}{1e3 * t_cpp:>10.3f}"
                  f"{t_ref / t_cpp:>8.2f}", flush=True)  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f}")
    if args.json:
        meta = dict(tokens=N, rank=args.rank, threads=args.threads, repeats=args.repeats,
                    cpu_time=args.cpu_time, torch=torch.__version__, load=os.getloadavg(),
                    bf16x3=lora_rank.cpp_rank_bf16x3())  # fmt: skip
        write_json(args.json, dict(meta=meta, rows=rows))  # atomic
    return 0


if __name__ == "__main__":
    sys.exit(main())
