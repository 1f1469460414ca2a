"""C++ CPU kernels vs the torch reference, per op, forward + backward, at realistic sizes.

Each op runs its torch reference functions (``ops/<op>.py`` ``_torch_forward``/``_torch_backward``
against the extension's ``<op>_forward``/``<op>_backward``) on the same inputs; the time is the
median of ``--repeats`` interleaved rounds after ``--warmup`` rounds. ratio = torch / cpp (> 1:
C++ faster).
These numbers decide ``backends.CPP_DEFAULT``.

    python benchmarks/ops/cpu_all.py [--ops rms_norm swiglu] [--json out.json] [--quick]

Threads: 2 (``--threads``), matching the CI box. On AVX2 CPUs bf16 GEMMs are ~100x slower than
fp32 in ATen, so bf16 ``lora_linear`` runs at a smaller N (``torch`` would take minutes).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

import torch

from lorafuse.files import write_json
from lorafuse.testing.timing import interleaved_medians

# ---- the ops' torch reference functions ----------------------------------------------------


def _reference(op: str, name: str) -> Callable:
    return getattr(importlib.import_module(f"lorafuse.ops.{op}"), name)


# ---- cases: name -> (make inputs, torch fwd+bwd, cpp fwd+bwd) -------------------------------


def lora_linear_case(ext, N, d, k, r, dtype):
    fwd = _reference("lora_linear", "_torch_forward")
    bwd = _reference("lora_linear", "_torch_backward")
    x, w = torch.randn(N, d).to(dtype), (torch.randn(k, d) / d**0.5).to(dtype)
    A, B = torch.randn(r, d) / d**0.5, torch.randn(k, r) / r**0.5  # fp32 adapters, as PEFT
    g, needs = torch.randn(N, k).to(dtype), (True, True, True, False)

    def run(f, b):
        y, xa = f(x, w, None, A, B, 2.0, None, 1.0)
        b(g, x, w, A, B, xa, 2.0, None, 1.0, needs)

    return lambda: run(fwd, bwd), lambda: run(ext.lora_linear_forward, ext.lora_linear_backward)


def rms_norm_case(ext, N, d, dtype):
    fwd, bwd = _reference("rms_norm", "_torch_forward"), _reference("rms_norm", "_torch_backward")
    x, w, g = torch.randn(N, d).to(dtype), torch.ones(d).to(dtype), torch.randn(N, d).to(dtype)

    def run(f, b):
        y, rstd = f(x, w, 1e-6)
        b(g, x, w, rstd, (True, True))

    return lambda: run(fwd, bwd), lambda: run(ext.rms_norm_forward, ext.rms_norm_backward)


def swiglu_case(ext, N, inter, dtype):
    fwd, bwd = _reference("swiglu", "_torch_forward"), _reference("swiglu", "_torch_backward")
    gate, up, g = (torch.randn(N, inter).to(dtype) for _ in range(3))

    def run(f, b):
        f(gate, up)
        b(g, gate, up)

    return lambda: run(fwd, bwd), lambda: run(ext.swiglu_forward, ext.swiglu_backward)


def rope_case(ext, B, Hq, Hk, T, D, dtype):
    fwd = _reference("rope", "_torch_forward")
    bwd = _reference("rope", "_torch_backward")
    q, k = torch.randn(B, Hq, T, D).to(dtype), torch.randn(B, Hk, T, D).to(dtype)
    ang = torch.rand(B, T, D) * 100
    cos, sin = ang.cos(), ang.sin()

    def run(f, b):
        qo, ko = f(q, k, cos, sin)
        b(qo, ko, cos, sin)

    return lambda: run(fwd, bwd), lambda: run(ext.rope_forward, ext.rope_backward)


def cross_entropy_case(ext, n, V):
    chunk = _reference("cross_entropy_chunks", "torch_chunk_forward_backward")
    logits = torch.randn(n, V) * 4
    targets = torch.randint(0, V, (n,))
    work = torch.empty_like(logits)

    def run(f):
        work.copy_(logits)  # the kernel overwrites its input: same copy cost on both sides
        f(work, targets, -100, 1.0 / n)

    return lambda: run(chunk), lambda: run(ext.cross_entropy_chunk_forward_backward)


def attention_case(ext, B, Hq, Hk, T, D, dtype):
    """torch's SDPA flash kernel (the reference, autograd) vs the C++ causal kernel, fwd+bwd."""
    from lorafuse.ops.attention import CausalAttentionFunction, causal_attention_reference

    q = torch.randn(B, Hq, T, D).to(dtype).requires_grad_(True)
    k = torch.randn(B, Hk, T, D).to(dtype).requires_grad_(True)
    v = torch.randn(B, Hk, T, D).to(dtype).requires_grad_(True)
    go = torch.randn(B, T, Hq, D).to(dtype)
    scale = D**-0.5

    def run(f):
        torch.autograd.grad(f(q, k, v, scale), (q, k, v), go)

    return (
        lambda: run(causal_attention_reference),
        lambda: run(CausalAttentionFunction.apply),
    )


def cases(quick: bool):
    """(op, dtype name, shape text, factory) at the sizes the brief asks for (``--quick``: tiny)."""
    f32, bf16 = torch.float32, torch.bfloat16
    N, Nb = (64, 16) if quick else (2048, 128)
    d, inter, V = (256, 352, 4000) if quick else (2048, 2816, 32000)
    out = []
    for dt, n in ((f32, N), (bf16, Nb)):
        out.append(
            (
                "lora_linear",
                dt,
                f"N={n} d={d} k={d} r=16",
                lambda e, n=n, dt=dt: lora_linear_case(e, n, d, d, 16, dt),
            )
        )
    for dt in (f32, bf16):
        out += [
            ("rms_norm", dt, f"N={N} d={d}", lambda e, dt=dt: rms_norm_case(e, N, d, dt)),
            ("rms_norm", dt, f"N={N} d={d // 2}", lambda e, dt=dt: rms_norm_case(e, N, d // 2, dt)),
            ("swiglu", dt, f"N={N} I={inter}", lambda e, dt=dt: swiglu_case(e, N, inter, dt)),
            (
                "rope",
                dt,
                f"B=1 Hq=16 Hk=4 T={N} D=64",
                lambda e, dt=dt: rope_case(e, 1, 16, 4, N, 64, dt),
            ),
        ]
    T = 64 if quick else 512
    for Hq, Hk in ((9, 3), (16, 16)):  # SmolLM2-135M, the 4-layer hidden-1024 Llama
        out.append(
            (
                "attention",
                f32,
                f"B=4 Hq={Hq} Hk={Hk} T={T} D=64",
                lambda e, Hq=Hq, Hk=Hk: attention_case(e, 4, Hq, Hk, T, 64, f32),
            )
        )
    n_ce = 64 if quick else 512
    out.append(
        ("cross_entropy", f32, f"chunk n={n_ce} V={V}", lambda e: cross_entropy_case(e, n_ce, V))
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="*", help="only these ops (default: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lorafuse import _ext

    ext = _ext.load_cpp()
    rows = []
    print(f"{'op':<14}{'dtype':<10}{'shape':<28}{'torch ms':>10}{'cpp ms':>10}{'ratio':>8}")
    for op, dt, shape, factory in cases(args.quick):
        if args.ops and op not in args.ops:
            continue
        torch.manual_seed(0)
        torch_fn, cpp_fn = factory(ext)
        t = interleaved_medians({"torch": torch_fn, "cpp": cpp_fn}, args.repeats, args.warmup)
        t_torch, t_cpp = t["torch"], t["cpp"]
        row = dict(
            op=op,
            dtype=str(dt).removeprefix("torch."),
            shape=shape,
            torch_ms=1e3 * t_torch,
            cpp_ms=1e3 * t_cpp,
            ratio=t_torch / t_cpp,
        )
        rows.append(row)
        print(
            f"{op:<14}{row['dtype']:<10}{shape:<28}{row['torch_ms']:>10.2f}"
            f"{row['cpp_ms']:>10.2f}{row['ratio']:>8.2f}",
            flush=True,
        )
    if args.json:
        meta = dict(
            threads=args.threads,
            repeats=args.repeats,
            torch=torch.__version__,
            load=os.getloadavg(),
        )
        write_json(args.json, dict(meta=meta, rows=rows))  # atomic
    return 0


if __name__ == "__main__":
    sys.exit(main())
