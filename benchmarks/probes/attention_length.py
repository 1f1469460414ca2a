"""Question: up to which length is the C++ causal attention faster than torch's flash kernel?
Answer: fp32 to 1x1024 (1.25x), MKL's bf16 GEMM to 1x2048 (1.2x), brgemm to 1x8192 (1.43x on
a 2-core AMX Xeon, sessions 5 and 7; 2.11x on a 2-core AVX-512-BF16 EPYC).
Constant: ``ops.attention.AUTO_MAX_LENGTH`` (src/lorafuse/ops/attention.py).

Causal attention, C++ kernel vs torch's flash kernel (SDPA), fwd + bwd, by sequence length
and dtype: where the crossover is (``ops.attention.AUTO_MAX_LENGTH``). Forces the cpp backend.
Shapes: Hq=9, Hk=3, D=64 (SmolLM2-135M). Times are wall-clock medians of ``--repeats`` runs after
one warm-up; bf16 rows name the products the kernel runs (``brgemm`` or ``mkl``) and its bf16
rounding (``native``: AVX-512-BF16, or ``aten``).

    python benchmarks/probes/attention_length.py
    python benchmarks/probes/attention_length.py --threads 1 --lengths 4x512,1x4096 --dtypes bf16

``--kernel`` times only the C++ kernel's forward and backward calls (no SDPA, no autograd), with
their medians and minima: the figures to compare two versions of the kernel.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lorafuse import _ext
from lorafuse.ops.attention import causal_attention, cpp_backward, cpp_forward, kernel_dtype
from lorafuse.testing.timing import interleaved_times, median_time

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LENGTHS = "4x512,1x512,4x1024,1x1024,1x2048,1x4096,1x8192"


def run(fn, q, k, v):
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    v = v.detach().requires_grad_()
    o = fn(q, k, v)
    o.float().sum().backward()


def fwd_bwd_time(fn, q, k, v, repeats: int, clock) -> float:
    """Median seconds of one forward + backward of ``fn`` (after one warm-up)."""
    return median_time(lambda: run(fn, q, k, v), repeats, clock=clock)


def sdpa(q, k, v):  # (B,H,T,D), as transformers' sdpa interface calls it (kv repeated)
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
    ).transpose(1, 2)


def ours(q, k, v):
    return causal_attention(q, k, v, q.shape[-1] ** -0.5, backend="cpp")


def products(q) -> str:
    """What the C++ kernel multiplies with for q: sgemm (fp32) or the bf16 path it picks, and for
    bf16 how it rounds P, dS and the outputs (AVX-512-BF16 'native' or ATen's conversion)."""
    if kernel_dtype(q) == torch.float32:
        return "sgemm" if q.dtype == torch.float32 else "sgemm (upcast)"
    ext = _ext.load_cpp()
    return f"{ext.attention_bf16_products(q.shape[-1])}, {ext.attention_bf16_rounding()} rounding"


def kernel_times(q, k, v, repeats: int, clock) -> str:
    """The C++ forward and backward calls alone: median (min) of each, in ms."""
    scale = q.shape[-1] ** -0.5
    dout = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)
    out, lse = cpp_forward(q, k, v, scale)
    fns = {
        "fwd": lambda: cpp_forward(q, k, v, scale),
        "bwd": lambda: cpp_backward(dout, q, k, v, out, lse, scale),
    }
    times = interleaved_times(fns, repeats, clock=clock)
    return ", ".join(
        f"{name} {statistics.median(ts) * 1e3:.2f} ms (min {min(ts) * 1e3:.2f})"
        for name, ts in times.items()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row")
    ap.add_argument("--lengths", default=LENGTHS, help="comma-separated BxT")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated, of bf16 and fp32")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time (with --threads 1: less disturbed by other load)",
    )
    ap.add_argument("--kernel", action="store_true", help="time only the C++ fwd and bwd calls")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    for item in args.lengths.split(","):
        B, T = (int(x) for x in item.split("x"))
        for name in args.dtypes.split(","):
            dt = DTYPES[name]
            q = torch.randn(B, 9, T, 64, dtype=dt)
            k = torch.randn(B, 3, T, 64, dtype=dt)
            v = torch.randn(B, 3, T, 64, dtype=dt)
            if args.kernel:
                times = kernel_times(q, k, v, args.repeats, clock)
                head = f"B={B} T={T} {name} ({products(q)}), {args.threads} threads"
                print(f"{head}, {args.clock} time: kernel {times}", flush=True)
                continue
            base, mine = (fwd_bwd_time(f, q, k, v, args.repeats, clock) for f in (sdpa, ours))
            print(
                f"B={B} T={T} {name} ({products(q)}), {args.threads} threads, {args.clock} time: "
                f"sdpa {base * 1e3:.2f} ms ours {mine * 1e3:.2f} ms  ours/sdpa speed {base / mine:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
