"""Causal attention, C++ kernel vs torch's flash kernel (SDPA), fwd + bwd, by sequence length
and dtype: where the crossover is (``ops.attention.AUTO_MAX_LENGTH``). Forces the cpp backend.
Shapes: Hq=9, Hk=3, D=64 (SmolLM2-135M). Times are wall-clock medians of ``--repeats`` runs after
one warm-up; bf16 rows name the products the kernel runs (``brgemm`` or ``mkl``).

    python benchmarks/bench_attention_length.py
    python benchmarks/bench_attention_length.py --threads 1 --lengths 4x512,1x4096 --dtypes bf16
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lorafuse import _ext
from lorafuse.ops.attention import causal_attention, kernel_dtype

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LENGTHS = "4x512,1x512,4x1024,1x1024,1x2048,1x4096,1x8192"


def run(fn, q, k, v):
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    v = v.detach().requires_grad_()
    o = fn(q, k, v)
    o.float().sum().backward()


def sdpa(q, k, v):  # (B,H,T,D), as transformers' sdpa interface calls it (kv repeated)
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
    ).transpose(1, 2)


def ours(q, k, v):
    return causal_attention(q, k, v, q.shape[-1] ** -0.5, backend="cpp")


def products(q) -> str:
    """What the C++ kernel multiplies with for q: sgemm (fp32) or the bf16 path it picks."""
    if kernel_dtype(q) == torch.float32:
        return "sgemm" if q.dtype == torch.float32 else "sgemm (upcast)"
    return _ext.load_cpp().attention_bf16_products(q.shape[-1])


def median_time(fn, q, k, v, repeats: int) -> float:
    run(fn, q, k, v)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        run(fn, q, k, v)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row")
    ap.add_argument("--lengths", default=LENGTHS, help="comma-separated BxT")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated, of bf16 and fp32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for item in args.lengths.split(","):
        B, T = (int(x) for x in item.split("x"))
        for name in args.dtypes.split(","):
            dt = DTYPES[name]
            q = torch.randn(B, 9, T, 64, dtype=dt)
            k = torch.randn(B, 3, T, 64, dtype=dt)
            v = torch.randn(B, 3, T, 64, dtype=dt)
            base = median_time(sdpa, q, k, v, args.repeats)
            mine = median_time(ours, q, k, v, args.repeats)
            print(
                f"B={B} T={T} {name} ({products(q)}), {args.threads} threads: sdpa {base:.3f}s "
                f"ours {mine:.3f}s  ours/sdpa speed {base / mine:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
