"""Triton kernels vs the torch reference, per op, forward and forward+backward, on one GPU.

Both sides run the op *contract* functions (``lorafuse.ops.<op>._torch_forward/_torch_backward``
vs ``lorafuse.triton.<op>.forward/backward``): exactly the choice ``backends.TRITON_DEFAULT`` makes.
At the end it prints the verdict per op (Triton becomes the CUDA default only where it is faster
forward+backward in every case, with errors at the dtype's rounding level) and the exact
``TRITON_DEFAULT`` line of ``src/lorafuse/backends.py`` that turns those ops on.
Per case: median time of ``--reps`` runs after ``--warmup`` runs (CUDA events around each run),
the ratio torch/triton (> 1: Triton faster), the peak memory above the inputs, and the relative
error of Triton's outputs against torch's (a wrong kernel is not fast). A tile sweep of the fused
LoRA GEMM against cuBLAS's plain x·Wᵀ says how far the Triton GEMM is from the library.

    python benchmarks/ops/gpu_all.py --device cuda --json gpu_results.json
    TRITON_INTERPRET=1 python benchmarks/ops/gpu_all.py --device cpu --tiny   # logic check on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

from lorafuse.files import write_json
from lorafuse.testing.timing import median_time

BF16 = torch.bfloat16


def _cases(tiny: bool) -> dict[str, list[dict]]:
    """Shapes: tokens 4x512 and 8x2048, hidden 2048/4096, r=16, intermediate 11008, vocab 32000."""
    if tiny:
        return {
            "lora_linear": [
                dict(N=20, d=40, k=24, r=4, p=0.0),
                dict(N=20, d=40, k=24, r=4, p=0.1, adapter="fp32"),
            ],
            "rms_norm": [dict(N=20, d=40)],
            "swiglu": [dict(N=20, I=50)],
            "rope": [dict(B=2, T=5, Hq=4, Hk=2, D=16)],
            "cross_entropy": [dict(n=8, V=300)],
            "dora_linear": [dict(N=20, d=40, k=24, r=4)],
            "moe_lora": [
                dict(T=20, H=40, I=24, E=5, K=2, r=4),
                dict(T=20, H=40, I=24, E=4, K=2, r=4, arch="gpt-oss"),
            ],  # fmt: skip
        }
    toks = (4 * 512, 8 * 2048)
    return {
        "lora_linear": [dict(N=n, d=d, k=d, r=16, p=0.0) for n in toks for d in (2048, 4096)]
        + [
            dict(N=8 * 2048, d=4096, k=11008, r=16, p=0.0),
            dict(N=8 * 2048, d=4096, k=4096, r=16, p=0.1),
            # PEFT's default autocast_adapter_dtype=True keeps adapters fp32 on a bf16 base
            dict(N=8 * 2048, d=4096, k=4096, r=16, p=0.0, adapter="fp32"),
        ],
        "rms_norm": [dict(N=n, d=d) for n in toks for d in (2048, 4096)],
        "swiglu": [dict(N=n, I=11008) for n in toks],
        "rope": [dict(B=4, T=512, Hq=32, Hk=8, D=128), dict(B=8, T=2048, Hq=32, Hk=8, D=128)],
        "cross_entropy": [dict(n=2048, V=32000), dict(n=8192, V=32000)],
        "dora_linear": [dict(N=n, d=4096, k=4096, r=16) for n in toks],
        # Qwen3-30B-A3B's expert layer (128 experts of width 768, top-8) and gpt-oss-20b's (32
        # experts of width 2880, top-4, clamped interleaved SwiGLU, transposed, biases); r 16
        "moe_lora": [dict(T=n, H=2048, I=768, E=128, K=8, r=16) for n in toks[:1]]
        + [dict(T=toks[0], H=2880, I=2880, E=32, K=4, r=16, arch="gpt-oss")],
    }


# --------------------------------------------------------------------------------------------
# Per-op setups: each returns {"torch": (fwd, fwdbwd), "triton": (fwd, fwdbwd)} closures and a
# function that returns the outputs to compare.


def _setup(op: str, c: dict, device, dtype):
    import importlib

    from lorafuse import backends

    tri = importlib.import_module(f"lorafuse.triton.{backends.TRITON_MODULES.get(op, op)}")
    g = torch.Generator(device=device).manual_seed(0)

    def rn(*shape, std=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dt)

    if op == "lora_linear":
        from lorafuse.ops import lora_linear as ref

        N, d, k, r, p = c["N"], c["d"], c["k"], c["r"], c["p"]
        adt = torch.float32 if c.get("adapter") == "fp32" else dtype
        x, W, gy = rn(N, d), rn(k, d, std=d**-0.5), rn(N, k)
        A, B = rn(r, d, std=d**-0.5, dt=adt), rn(k, r, dt=adt)
        mask = (torch.rand(N, d, generator=g, device=device) >= p) if p > 0 else None
        keep, needs = 1.0 - p, (True, True, True, False)

        def mk(f, b):
            return (lambda: f(x, W, None, A, B, 2.0, mask, keep),
                    lambda: b(gy, x, W, A, B, f(x, W, None, A, B, 2.0, mask, keep)[1], 2.0, mask, keep, needs))  # fmt: skip

        flops = 2 * N * d * k * 3  # y, dx and (frozen W: no dW) -- base GEMMs only, per fwd+bwd
        return {"torch": mk(ref._torch_forward, ref._torch_backward),
                "triton": mk(tri.forward, tri.backward), "flops": flops}  # fmt: skip
    if op == "rms_norm":
        from lorafuse.ops import rms_norm as ref

        x, w, gy = rn(c["N"], c["d"]), 1 + rn(c["d"], std=0.1), rn(c["N"], c["d"])

        def mk(f, b):
            return (lambda: f(x, w, 1e-6),
                    lambda: b(gy, x, w, f(x, w, 1e-6)[1], (True, True)))  # fmt: skip

        return {
            "torch": mk(ref._torch_forward, ref._torch_backward),
            "triton": mk(tri.forward, tri.backward),
        }
    if op == "swiglu":
        from lorafuse.ops import swiglu as ref

        a, u, gy = rn(c["N"], c["I"]), rn(c["N"], c["I"]), rn(c["N"], c["I"])

        def mk(f, b):
            return (lambda: f(a, u), lambda: (f(a, u), b(gy, a, u)))

        return {
            "torch": mk(ref._torch_forward, ref._torch_backward),
            "triton": mk(tri.forward, tri.backward),
        }
    if op == "rope":
        B_, T, Hq, Hk, D = c["B"], c["T"], c["Hq"], c["Hk"], c["D"]
        q, k = rn(B_, Hq, T, D), rn(B_, Hk, T, D)
        cos, sin = rn(B_, T, D, dt=torch.float32), rn(B_, T, D, dt=torch.float32)
        from lorafuse.ops import rope as ref

        f_ref, b_ref = ref._torch_forward, ref._torch_backward

        def mk(f, b):
            return (lambda: f(q, k, cos, sin), lambda: (f(q, k, cos, sin), b(q, k, cos, sin)))

        return {"torch": mk(f_ref, b_ref), "triton": mk(tri.forward, tri.backward)}
    if op == "cross_entropy":
        from lorafuse.ops import cross_entropy_chunks as ref

        n, V = c["n"], c["V"]
        logits = rn(n, V, std=4.0, dt=torch.float32)
        targets = torch.randint(0, V, (n,), generator=g, device=device)
        targets[::7] = -100
        bufs = {"torch": logits.clone(), "triton": logits.clone()}

        def mk(f, name):
            # forward+backward in one call, overwriting its buffer: timed runs reuse it (the
            # values stay finite, the work is the same), so no copy pass dilutes the ratio
            run = lambda: f(bufs[name], targets, -100, 0.5)  # noqa: E731
            return run, run

        def reset():
            for buf in bufs.values():
                buf.copy_(logits)

        return {"torch": mk(ref.torch_chunk_forward_backward, "torch"),
                "triton": mk(tri.chunk_forward_backward, "triton"), "bufs": bufs, "reset": reset}  # fmt: skip
    if op == "dora_linear":  # the whole op (ops/dora.py) on each backend, fwd and fwd+bwd
        from lorafuse.ops.dora import dora_linear

        N, d, k, r = c["N"], c["d"], c["k"], c["r"]
        x, W, gy = rn(N, d).requires_grad_(True), rn(k, d, std=d**-0.5), rn(N, k)
        A, B = rn(r, d, std=d**-0.5).requires_grad_(True), rn(k, r).requires_grad_(True)
        m = (1 + rn(k, std=0.1)).requires_grad_(True)

        def mk(backend):
            fwd = lambda: dora_linear(x, W, None, A, B, m, 2.0, backend=backend)  # noqa: E731
            return (lambda: fwd().detach(),
                    lambda: torch.autograd.grad(fwd(), [x, A, B, m], gy))  # fmt: skip

        return {"torch": mk("torch"), "triton": mk("triton"), "flops": 2 * N * d * k * 3}
    if op == "moe_lora":
        return _moe_setup(c, rn, g, device, dtype, tri)
    raise ValueError(op)


def _moe_setup(c, rn, g, device, dtype, tri):
    """The op's contract (``ops/moe_lora_groups`` vs ``triton/moe_lora``) after the routing,
    which both share: forward, and forward (saving z, xa) + every backward output."""
    from lorafuse.ops import moe_lora_groups as ref
    from lorafuse.ops.moe_lora import Activation, ExpertStack

    T, H, inner, E, K, r = c["T"], c["H"], c["I"], c["E"], c["K"], c["r"]
    oss = c.get("arch") == "gpt-oss"
    act = Activation("clamped_swiglu", interleaved=True) if oss else Activation("swiglu")

    def stack(out_dim, in_dim):
        w = (
            rn(E, in_dim, out_dim, std=in_dim**-0.5)
            if oss
            else rn(E, out_dim, in_dim, std=in_dim**-0.5)
        )
        b = rn(E, out_dim, std=0.1) if oss else None
        a = rn(E, r, in_dim, std=in_dim**-0.5, dt=torch.float32)  # PEFT: fp32 adapters
        bb = rn(out_dim, r * E, std=r**-0.5, dt=torch.float32).view(out_dim, r, E).permute(2, 0, 1)
        return ExpertStack(w, b, a, bb, 2.0, oss)

    x, gy = rn(T, H), rn(T, H)
    gu, down = stack(2 * inner, H), stack(H, inner)
    top, idx = torch.randn(T, E, generator=g, device=device).topk(K, dim=-1)
    order, counts = ref.route(idx, E)
    tok = torch.div(order, K, rounding_mode="floor")
    ws = top.softmax(-1).reshape(-1)[order].to(dtype)
    args = (x, tok, ws, counts, gu, down, act)

    def mk(f, b):
        def both():
            out, saved = f(*args, save=True)
            return out, b(gy, *args, True, True, True, saved)

        return lambda: f(*args)[0], both

    flops = 2 * T * K * H * 3 * inner * 3  # gate/up + down, forward + dx + the down's u (base only)
    return {"torch": mk(ref.forward, ref.backward), "triton": mk(tri.forward, tri.backward),
            "flops": flops}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Timing, memory, correctness.


def time_ms(fn, device, reps: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after ``warmup`` runs: CUDA events around
    each run on a GPU (no host sync inside the loop), the shared harness's clock elsewhere."""
    if device.type != "cuda":
        return median_time(fn, reps, warmup) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def peak_mib(fn, device) -> float | None:
    """Peak allocated memory above what was allocated before ``fn`` (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def rel_errors(setup) -> list[float]:
    """‖triton − torch‖/‖torch‖ for every tensor output of one forward+backward."""
    if "reset" in setup:
        setup["reset"]()
    a = _flat(setup["torch"][1]())
    b = _flat(setup["triton"][1]())
    if "bufs" in setup:  # in-place gradient buffers are outputs too
        a, b = a + [setup["bufs"]["torch"]], b + [setup["bufs"]["triton"]]
    errs = []
    for x, y in zip(a, b):
        x, y = x.double(), y.double()
        errs.append(float((x - y).norm() / x.norm().clamp_min(1e-30)))
    return errs


def bench_case(op, c, device, dtype, reps, warmup) -> dict:
    setup = _setup(op, c, device, dtype)
    row = {"op": op, "shape": c, "rel_err": rel_errors(setup)}
    for name in ("torch", "triton"):
        fwd, both = setup[name]
        row[f"{name}_fwd_ms"] = time_ms(fwd, device, reps, warmup)
        row[f"{name}_fwdbwd_ms"] = time_ms(both, device, reps, warmup)
        row[f"{name}_peak_mib"] = peak_mib(both, device)
    row["speedup_fwd"] = row["torch_fwd_ms"] / row["triton_fwd_ms"]
    row["speedup_fwdbwd"] = row["torch_fwdbwd_ms"] / row["triton_fwdbwd_ms"]
    if "flops" in setup:
        row["triton_tflops"] = setup["flops"] / row["triton_fwdbwd_ms"] / 1e9
    return row


def gemm_sweep(device, reps, warmup, tiny) -> list[dict]:
    """The fused forward GEMM at one large shape under several tile configs, vs cuBLAS x·Wᵀ."""
    from lorafuse.triton import lora_linear as tri

    N, d, k, r = (32, 48, 40, 4) if tiny else (8 * 2048, 4096, 4096, 16)
    x, W = torch.randn(N, d, device=device).to(BF16), torch.randn(k, d, device=device).to(BF16)
    xa, B = torch.randn(N, r, device=device).to(BF16), torch.randn(k, r, device=device).to(BF16)
    out = torch.empty(N, k, device=device, dtype=BF16)
    flops = 2 * N * d * k
    rows = [
        {
            "config": "cublas x@W.t() (no LoRA)",
            "ms": time_ms(lambda: x @ W.t(), device, reps, warmup),
        }
    ]
    configs = [None] if device.type != "cuda" else [
        (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 256, 64, 4, 4),
    ]  # fmt: skip
    for cfg in configs:
        kw = None
        if cfg:
            bm, bn, bk, nw, ns = cfg
            kw = dict(
                BLOCK_M=bm,
                BLOCK_N=bn,
                BLOCK_K=bk,
                BLOCK_R=16,
                GROUP_M=8,
                num_warps=nw,
                num_stages=ns,
            )
        try:
            ms = time_ms(lambda kw=kw: tri._lora_gemm(x, W.t(), xa, B.t(), None, None, 2.0, 1.0, out, kw),
                         device, reps, warmup)  # fmt: skip
            rows.append({"config": str(cfg or "default"), "ms": ms})
        except Exception as err:  # an infeasible tile (shared memory) is a finding, not a crash
            rows.append({"config": str(cfg), "error": repr(err)[:300]})
    for row in rows:
        if "ms" in row:
            row["tflops"] = flops / row["ms"] / 1e9
    return rows


def _environment(device) -> dict:
    import triton

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda)
    else:
        env.update(device=f"{device.type} (TRITON_INTERPRET, logic check only)")
    return env


def _table(rows) -> str:
    lines = [f"{'op':14} {'shape':48} {'torch ms':>9} {'triton ms':>9} {'x fwd':>6} {'x f+b':>6} "
             f"{'MiB t/tr':>13} {'max rel err':>11}"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"{r['op']:14} {json.dumps(r['shape']):48} ERROR {r['error'][:80]}")
            continue
        mem = (f"{r['torch_peak_mib']:.0f}/{r['triton_peak_mib']:.0f}" if r["torch_peak_mib"] is not None
               else "-")  # fmt: skip
        lines.append(
            f"{r['op']:14} {json.dumps(r['shape']):48} {r['torch_fwdbwd_ms']:9.3f} "
            f"{r['triton_fwdbwd_ms']:9.3f} {r['speedup_fwd']:6.2f} {r['speedup_fwdbwd']:6.2f} "
            f"{mem:>13} {max(r['rel_err'] or [0]):11.2e}"
        )
    return "\n".join(lines)


# Triton's outputs may differ from torch's by the dtype's rounding (bf16: 2^-8 relative per op);
# a larger relative error is a wrong kernel, never a default.
MAX_REL_ERR = {"torch.bfloat16": 2e-2, "torch.float32": 1e-4}


def triton_default_verdict(results: dict) -> dict:
    """Per op: fwd+bwd torch/triton ratios over its cases and whether it may be the default."""
    by_op: dict[str, list[dict]] = {}
    for row in results["cases"]:
        by_op.setdefault(row["op"], []).append(row)
    limit = MAX_REL_ERR.get(results["dtype"], 1e-4)
    ops = {}
    for op, rows in by_op.items():
        ok = [r for r in rows if "error" not in r]
        ratios = [r["speedup_fwdbwd"] for r in ok]
        worst_err = max((max(r["rel_err"] or [0.0]) for r in ok), default=float("nan"))
        faster = bool(ok) and len(ok) == len(rows) and min(ratios) > 1.0 and worst_err <= limit
        ops[op] = {"cases": len(rows), "errors": len(rows) - len(ok), "min_ratio": min(ratios, default=None),
                   "max_ratio": max(ratios, default=None), "max_rel_err": worst_err, "faster": faster}  # fmt: skip
    on = sorted(op for op, v in ops.items() if v["faster"])
    gpu = results["environment"].get("gpu", results["environment"].get("device", "this device"))
    numbers = ", ".join(f"{op} {ops[op]['min_ratio']:.2f}-{ops[op]['max_ratio']:.2f}x" for op in on)
    names = "{" + ", ".join(f'"{op}"' for op in on) + "}" if on else "set()"
    comment = f"  # benchmarks/ops/gpu_all.py f+b torch/triton on {gpu}: {numbers}" if on else ""
    line = f"TRITON_DEFAULT: set[str] = {names}{comment}"
    return {"ops": ops, "line": line}


def _verdict_text(verdict: dict) -> str:
    lines = ["Triton as the CUDA default (faster f+b in every case, errors at rounding level):"]
    for op, v in sorted(verdict["ops"].items()):
        if v["min_ratio"] is None:
            lines.append(f"  {op:14} no measurement ({v['errors']} errors): stays torch")
            continue
        say = "FASTER: turn on" if v["faster"] else "not faster everywhere: stays torch"
        lines.append(f"  {op:14} torch/triton f+b {v['min_ratio']:.2f}x..{v['max_ratio']:.2f}x over "
                     f"{v['cases']} cases, max rel err {v['max_rel_err']:.1e}: {say}")  # fmt: skip
    lines.append(
        "The line for src/lorafuse/backends.py (replacing `TRITON_DEFAULT: set[str] = set()`):"
    )
    lines.append("  " + verdict["line"])
    return "\n".join(lines)


def _write_json(path, data):
    write_json(path, data, default=str)  # atomic: partial results survive a timeout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter logic check)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ops", default="lora_linear,rms_norm,swiglu,cross_entropy,rope,dora_linear,"
                    "moe_lora")  # fmt: skip
    ap.add_argument("--no-sweep", action="store_true", help="skip the GEMM tile sweep")
    ap.add_argument("--json", default=None, help="write all results here (atomically)")
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"  # before any lorafuse.triton import
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_all: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    dtype = BF16 if device.type == "cuda" else torch.float32  # bf16 GEMMs crawl on an AVX2 CPU
    results = {"environment": _environment(device), "dtype": str(dtype), "reps": args.reps,
               "warmup": args.warmup, "cases": [], "gemm_sweep": []}  # fmt: skip
    cases = _cases(args.tiny)
    for op in args.ops.split(","):
        for c in cases[op]:
            t0 = time.perf_counter()
            try:
                row = bench_case(op, c, device, dtype, args.reps, args.warmup)
            except Exception as err:  # keep going: one broken op must not hide the others
                traceback.print_exc()
                row = {"op": op, "shape": c, "error": repr(err)[:500]}
            row["wall_s"] = time.perf_counter() - t0
            results["cases"].append(row)
            print(_table([row]).splitlines()[1], flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.json:
                _write_json(args.json, results)  # partial results survive a timeout
    if not args.no_sweep:
        try:
            results["gemm_sweep"] = gemm_sweep(device, args.reps, args.warmup, args.tiny)
        except Exception as err:
            traceback.print_exc()
            results["gemm_sweep"] = [{"error": repr(err)[:500]}]
    if args.json:
        _write_json(args.json, results)
    print("\n" + _table(results["cases"]))
    print("\nGEMM sweep (fused forward, bf16):")
    for r in results["gemm_sweep"]:
        print("  ", json.dumps(r))
    results["triton_default"] = triton_default_verdict(results)
    if args.json:
        _write_json(args.json, results)
    print("\n" + _verdict_text(results["triton_default"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
