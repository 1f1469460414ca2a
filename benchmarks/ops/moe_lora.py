"""The fused expert op on CPU: torch body (group loop in Python) vs the C++ kernel (group loop in
C++), and both against stock PEFT's way (dense ``W + s·B·A`` for every expert, transformers' loop).

One MoE layer of Qwen3-30B-A3B's geometry (hidden 2048, experts of width 768, top-8, LoRA r 16 on
gate_up and down) with ``--experts`` experts (128 in the model) at ``--tokens`` tokens, forward +
backward, bf16 and fp32, the three interleaved in rotating order; medians of ``--repeats``.
ratio = torch / cpp and stock / cpp (> 1: C++ faster).

    python benchmarks/ops/moe_lora.py [--tokens 256] [--experts 32] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os

import torch

from lorafuse.ops.moe_lora import ExpertStack, moe_lora, moe_lora_reference
from lorafuse.testing.timing import interleaved_medians

HIDDEN, WIDTH, TOP_K, RANK = 2048, 768, 8, 16


def case(tokens: int, experts: int, dtype):
    gen = torch.Generator().manual_seed(0)

    def stack(out_dim, in_dim):
        w = (torch.randn(experts, out_dim, in_dim, generator=gen) * 0.02).to(dtype)
        a = torch.randn(experts, RANK, in_dim, generator=gen) * 0.02
        b = torch.randn(experts, out_dim, RANK, generator=gen) * 0.02
        return ExpertStack(w, None, a.requires_grad_(), b.requires_grad_(), 1.0)

    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype).requires_grad_()
    logits = torch.randn(tokens, experts, generator=gen)
    top, idx = logits.softmax(-1).topk(TOP_K, dim=-1)
    w = (top / top.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    return x, idx, w, stack(2 * WIDTH, HIDDEN), stack(HIDDEN, WIDTH)


def step(fn, args, g):
    def run():
        out = fn(*args)
        out.backward(g)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"tokens {args.tokens}, experts {args.experts}, top-{TOP_K}, hidden {HIDDEN}, width "
          f"{WIDTH}, r {RANK}, {args.threads} threads, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x, idx, w, gu, down = case(args.tokens, args.experts, dtype)
        g = torch.randn(x.shape).to(dtype)
        fns = {
            "stock": step(moe_lora_reference, (x, idx, w, gu, down), g),
            "torch": step(lambda *a: moe_lora(*a, backend="torch"), (x, idx, w, gu, down), g),
            "cpp": step(lambda *a: moe_lora(*a, backend="cpp"), (x, idx, w, gu, down), g),
        }
        med = interleaved_medians(fns, args.repeats, warmup=1, rotate=True)
        print(f"{name}: stock {med['stock'] * 1e3:.0f} ms, torch {med['torch'] * 1e3:.0f} ms, "
              f"cpp {med['cpp'] * 1e3:.0f} ms; torch/cpp {med['torch'] / med['cpp']:.2f}x, "
              f"stock/cpp {med['stock'] / med['cpp']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
