"""Question: is a quantized head's input gradient, summed by row blocks, as accurate as one GEMM?
Answer: yes: rms error 1.653e-3 against one dense bf16 GEMM's 1.663e-3 (2.342e-3 once stored
in bf16) (64 x 65536 x 2048, 2-core AMD EPYC with AVX-512-BF16).
Constant: ``ops.weights.input_grad_by_row_blocks`` kept (src/lorafuse/ops/weights.py).

``g (n, V) · W (V, H)`` in bf16 for an NF4 head ``W``, against float64 on the same dequantized
weights: one dense bf16 GEMM (rounds once); :func:`lorafuse.ops.weights.input_grad_by_row_blocks`
(a bf16 product per row block, summed in fp32), before and after the final rounding to bf16 that
the fused loss stores. Printed: each one's rms error relative to the oracle's rms.

    python benchmarks/probes/head_grad_rounding.py [--rows 64] [--vocab 65536] [--hidden 2048] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from lorafuse.models import nf4
from lorafuse.ops import weights
from lorafuse.testing import rms_error


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    w = torch.randn(args.vocab, args.hidden) * 0.02
    head = nf4.NF4Weight(**nf4.quantize_nf4(w), shape=w.shape, dtype=torch.bfloat16)
    dense = head.dequantize(torch.bfloat16)  # (V, H): what every path multiplies by
    g = (torch.randn(args.rows, args.vocab) / args.vocab**0.5).bfloat16()  # d loss / d logits
    oracle = g.double() @ dense.double()
    scale = float(oracle.pow(2).mean().sqrt())
    blocks = weights.input_grad_by_row_blocks(g, head, torch.bfloat16)  # fp32 sum
    print(f"{args.rows} x {args.vocab} x {args.hidden}, NF4 head in "
          f"{weights.ROW_BLOCK_BYTES >> 20} MiB row blocks; rms error / rms of the float64 result:")  # fmt: skip
    for name, t in (
        ("one dense bf16 GEMM", g @ dense),
        ("row blocks, fp32 sum", blocks),
        ("row blocks, stored bf16", blocks.bfloat16()),
    ):
        print(f"  {name:24s} {rms_error(t, oracle) / scale:.3e}")


if __name__ == "__main__":
    main()
