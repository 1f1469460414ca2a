"""Causal attention, C++ kernel vs torch's flash kernel (SDPA), fwd + bwd, by sequence length
and dtype: where the crossover is (``ops.attention.AUTO_MAX_LENGTH``). Forces the cpp backend.

    python benchmarks/bench_attention_length.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from lorafuse.ops.attention import causal_attention

torch.set_num_threads(2)


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


for B, T in ((4, 512), (1, 512), (4, 1024), (1, 1024), (1, 2048), (1, 8192)):
    for dt in (torch.bfloat16, torch.float32):
        q = torch.randn(B, 9, T, 64, dtype=dt)
        k = torch.randn(B, 3, T, 64, dtype=dt)
        v = torch.randn(B, 3, T, 64, dtype=dt)
        res = {}
        for name, fn in (("sdpa", sdpa), ("ours", ours)):
            run(fn, q, k, v)
            ts = []
            for _ in range(3 if T < 8192 else 1):
                t = time.perf_counter()
                run(fn, q, k, v)
                ts.append(time.perf_counter() - t)
            res[name] = statistics.median(ts)
        print(
            f"B={B} T={T} {dt}: sdpa {res['sdpa']:.3f}s ours {res['ours']:.3f}s  ours/sdpa speed {res['sdpa'] / res['ours']:.2f}x",
            flush=True,
        )
