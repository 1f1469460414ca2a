"""The fused cross-entropy's two (rows, V) GEMMs per chunk, at several chunk sizes.

Each chunk multiplies against the whole (V, H) output weight in forward and again for the input
gradient, so small chunks stream that weight many times. This times exactly those two GEMMs over
N tokens for each chunk size (median of interleaved repeats), which is what sets
``ops.cross_entropy.CHUNK_BYTES``.

    python benchmarks/bench_ce_chunk.py [--tokens 2048 --hidden 1024 --vocab 32000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _run(hidden: torch.Tensor, weight: torch.Tensor, rows: int) -> None:
    for s in range(0, hidden.shape[0], rows):
        logits = hidden[s : s + rows] @ weight.t()  # (rows, V)
        logits @ weight  # (rows, H): the input gradient's product


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", type=int, nargs="*", default=[256, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden)
    hidden = torch.randn(args.tokens, args.hidden)
    times: dict[int, list[float]] = {r: [] for r in args.rows}
    for r in args.rows:  # warm-up
        _run(hidden, weight, r)
    for _ in range(args.repeats):  # interleaved, so machine noise hits every size alike
        for r in args.rows:
            t = time.perf_counter()
            _run(hidden, weight, r)
            times[r].append(time.perf_counter() - t)
    print(f"{'chunk rows':>10} {'fp32 MiB':>9} {'median s':>9} {'min s':>7}")
    for r, ts in times.items():
        mib = r * args.vocab * 4 / 2**20
        print(f"{r:>10} {mib:>9.0f} {statistics.median(ts):>9.3f} {min(ts):>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
