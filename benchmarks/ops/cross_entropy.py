"""The fused linear cross-entropy, forward + backward: stock's path against lorafuse's op, and both
against the two (rows, V) GEMMs no implementation avoids.

``fused_linear_cross_entropy`` forward + backward (frozen weight: the lm_head of a LoRA model),
stock's path (``F.linear`` + ``.float()`` + ``F.cross_entropy``, HF's causal-LM loss) and the same
two GEMMs alone, full-size into preallocated outputs, in the GEMM dtype
(:func:`lorafuse.hardware.matmul_dtype`), at SmolLM2-135M's lm_head (N=2044, H=576, V=49152)
and llama-4l-1024's (N=2044, H=1024, V=32000); medians of interleaved repeats.
efficiency = GEMM time / op time. ``--baseline-rev REV`` also times
``src/lorafuse/ops/cross_entropy.py`` (and its ``cross_entropy_chunks.py``) as they were at git
revision REV (same C++ extension) in the same interleaved run. The chunk size itself:
``probes/ce_chunk_bytes.py``.

    python benchmarks/ops/cross_entropy.py [--baseline-rev HEAD] [--cases smollm2-bf16 ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from lorafuse.testing.timing import interleaved_medians

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# name: (N tokens, H, V, dtype); N = 4 x 512 minus each sequence's last position.
CASES = {
    "smollm2-bf16": (2044, 576, 49152, "bf16"),
    "llama4l-bf16": (2044, 1024, 32000, "bf16"),
    "llama4l-fp32": (2044, 1024, 32000, "fp32"),
}


def _source_at(rev: str, name: str, required: bool = True) -> types.ModuleType | None:
    """``src/lorafuse/ops/<name>.py`` as it was at git revision ``rev``, run as a fresh module
    (None where ``rev`` has no such file and it is not ``required``)."""
    root = Path(__file__).resolve().parents[2]
    path = f"src/lorafuse/ops/{name}.py"
    show = ["git", "-C", str(root), "show", f"{rev}:{path}"]
    done = subprocess.run(show, capture_output=True, text=True, check=required)
    if done.returncode:
        return None
    module = types.ModuleType(f"{name}_at_{rev}")
    exec(compile(done.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def _module_at(rev: str) -> types.ModuleType:
    """``lorafuse.ops.cross_entropy`` as it was at git revision ``rev`` (a fresh module), with
    the chunk loop it imports (``ops/cross_entropy_chunks.py``) from the same revision where
    ``rev`` has one."""
    key = "lorafuse.ops.cross_entropy_chunks"
    chunks = _source_at(rev, "cross_entropy_chunks", required=False)
    saved = sys.modules.get(key)
    if chunks is not None:  # `from lorafuse.ops.cross_entropy_chunks import ...` finds this one
        sys.modules[key] = chunks
    try:
        return _source_at(rev, "cross_entropy")
    finally:
        if saved is not None:
            sys.modules[key] = saved
        else:
            sys.modules.pop(key, None)


def _op_case(N, H, V, dtype, modules: dict[str, types.ModuleType]) -> dict:
    """name -> zero-argument function, for one shape."""
    from lorafuse.hardware import matmul_dtype

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, H, generator=gen) * H**-0.5).to(dtype)  # frozen
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    mm = matmul_dtype(hidden.device, dtype)
    h_mm, w_mm = hidden.to(mm), weight.to(mm)
    g_mm = (torch.randn(N, V, generator=gen) * 1e-5).to(mm)
    logits, dx = torch.empty(N, V, dtype=mm), torch.empty(N, H, dtype=mm)

    def gemms():  # the unavoidable products, alone, outputs preallocated
        torch.mm(h_mm, w_mm.t(), out=logits)
        torch.mm(g_mm, w_mm, out=dx)

    def stock():
        h = hidden.detach().requires_grad_(True)
        F.cross_entropy(F.linear(h, weight).float(), targets).backward()

    def fused(module):
        def run():
            h = hidden.detach().requires_grad_(True)
            module.fused_linear_cross_entropy(h, weight, targets).backward()

        return run

    return {"gemms": gemms, "stock": stock, **{k: fused(m) for k, m in modules.items()}}


def compare(args) -> None:
    from lorafuse.ops import cross_entropy

    modules = {"lorafuse": cross_entropy}
    if args.baseline_rev:
        modules = {f"@{args.baseline_rev}": _module_at(args.baseline_rev), **modules}
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"threads {torch.get_num_threads()}, load {' '.join(load)} (start), medians of "
          f"{args.repeats} interleaved repeats, seconds per forward + backward")  # fmt: skip
    for case in args.cases:
        N, H, V, dt = CASES[case]
        fns = _op_case(N, H, V, DTYPES[dt], modules)
        med = interleaved_medians(fns, args.repeats)
        cells = "  ".join(
            f"{k} {s:.3f}" + ("" if k == "gemms" else f" ({med['gemms'] / s:.0%})")
            for k, s in med.items()
        )
        print(f"{case:>13} N={N} H={H} V={V}: {cells}")
    with open("/proc/loadavg") as f:
        print(f"load {' '.join(f.read().split()[:3])} (end); (x%) = efficiency, gemms / time")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", nargs="*", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--baseline-rev", help="also time the op at this git revision")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
