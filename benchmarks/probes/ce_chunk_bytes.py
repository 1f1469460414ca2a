"""Question: how many bytes of logits should one chunk of the fused cross-entropy hold?
Answer: 128 MiB of fp32 logits: 1.64 s at 1024 rows against 1.85 s at 256, 1.60 s unchunked
(V=32000, H=1024, 2048 tokens, fp32, 2 threads, 2-core AVX2 EPYC).
Constant: ``ops.cross_entropy.CHUNK_BYTES`` (src/lorafuse/ops/cross_entropy.py).

Each chunk multiplies against the whole (V, H) output weight in forward and again for the input
gradient, so small chunks stream that weight many times. This times exactly those two GEMMs over
N tokens for each chunk size (median and minimum of interleaved repeats). The op itself against
stock's loss: ``benchmarks/ops/cross_entropy.py``.

    python benchmarks/probes/ce_chunk_bytes.py [--tokens 2048 --hidden 1024 --vocab 32000 --dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from lorafuse.testing.timing import interleaved_times

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def products(hidden: torch.Tensor, weight: torch.Tensor, rows: int) -> None:
    for s in range(0, hidden.shape[0], rows):
        logits = hidden[s : s + rows] @ weight.t()  # (rows, V)
        logits @ weight  # (rows, H): the input gradient's product


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--rows", type=int, nargs="*", default=[256, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    weight = torch.randn(args.vocab, args.hidden).to(dtype)
    hidden = torch.randn(args.tokens, args.hidden).to(dtype)
    fns = {r: lambda r=r: products(hidden, weight, r) for r in args.rows}
    times = interleaved_times(fns, args.repeats)
    print(f"{'chunk rows':>10} {'fp32 MiB':>9} {'median s':>9} {'min s':>7}")
    for r, ts in times.items():
        mib = r * args.vocab * 4 / 2**20
        print(f"{r:>10} {mib:>9.0f} {statistics.median(ts):>9.3f} {min(ts):>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
