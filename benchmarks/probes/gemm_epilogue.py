"""Question: can a GEMM of our own carry the passes after a projection in its epilogue?
Answer: no: the fused gate/up + rank-r up-adds + SwiGLU ran at 0.58-0.72x (1 thread) and
0.80-0.96x (2 threads) of the library's separate passes (2-core AMX Xeon).
Constant: none set; the frozen products stay torch.mm (oneDNN), the passes their own kernels.

Closing the gap to the roofline on SmolLM2-135M needs the memory-bound passes that follow the
frozen products (the rank-r up-add, SwiGLU, their backward twins) folded into the products'
epilogues. torch's ``mm`` (oneDNN) takes no such epilogue, so the GEMM would have to be ours,
built on the brgemm micro-kernel torch exports (``benchmarks/probes/gemm_epilogue.cpp``, AMX only).
This measures what such a GEMM costs before any fusion, at SmolLM2's projection shapes
(4 x 512 tokens, bf16), as ratios torch.mm / ours (> 1: ours is faster):

* ``products``: the brgemm calls alone, no output written (an upper bound);
* ``round+store``: each fp32 tile rounded to bf16 and stored into C (the plain GEMM);
* ``round only``: rounded into a per-thread staging row, C never written (the rounding's share);
* ``stream store``: stored with non-temporal stores (no read-for-ownership of C's lines);

each with tasks dealt from a counter and, for ``round+store``, also in equal static shares.
Last, the fusion itself: the MLP's up half (gate and up products, both rank-r up-adds, SwiGLU)
as the library runs it against one probe kernel doing the adds and SwiGLU in its epilogue
(``gate_up_swiglu``, the same roundings; checked against the library's outputs first), and,
timed only, that kernel without its rank-r terms, and without those and the sigmoid.
The weight is packed once, as a frozen weight could be; ``+pack`` adds transposing and packing it
every call.
Each ratio is the median of per-pair ratios, the two sides timed back to back in alternating
order, so a change of the machine's speed during the run hits both sides of a pair alike.

    python benchmarks/probes/gemm_epilogue.py [--repeats 15] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from lorafuse import _ext, hardware, heap
from lorafuse.testing.timing import paired_ratio

M = 2048  # tokens: SmolLM2-135M at 4 x 512
SHAPES = {  # name: (in, out) of the projection
    "gate/up fwd 576->1536": (576, 1536),
    "down fwd 1536->576": (1536, 576),
    "q/o fwd 576->576": (576, 576),
}
EPILOGUES = {"products": 0, "round+store": 1, "round only": 2, "stream store": 3}


def load_probe():
    from torch.utils.cpp_extension import load

    flags = _ext.compile_flags() + ["-mavx512bf16"]  # the library's AVX-512 flags (AMX has them)
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_epilogue.cpp")
    return load("lorafuse_gemm_probe", [src], extra_cflags=flags, extra_ldflags=["-fopenmp"])


def cases(probe, fan_in: int, fan_out: int) -> dict:
    x = torch.randn(M, fan_in).to(torch.bfloat16)
    w = torch.randn(fan_out, fan_in).to(torch.bfloat16)
    packed = probe.pack_wt(w.t().contiguous())
    want = torch.mm(x, w.t()).float()
    got = probe.gemm(x, packed, fan_out, 64, 4, True, 1).float()
    err = (got - want).abs().max().item()
    assert err <= 1e-2 * want.abs().max().item(), f"probe GEMM disagrees with torch.mm: {err}"

    def ours(mode: int, dealt: bool = True, pack: bool = False):
        if pack:
            return lambda: probe.gemm(
                x, probe.pack_wt(w.t().contiguous()), fan_out, 64, 4, dealt, mode
            )
        return lambda: probe.gemm(x, packed, fan_out, 64, 4, dealt, mode)

    out = {name: ours(mode) for name, mode in EPILOGUES.items()}
    out["round+store, static"] = ours(1, dealt=False)
    out["round+store +pack"] = ours(1, pack=True)
    return {"reference": lambda: torch.mm(x, w.t()), **out}


def fused_case(probe, rank: int = 16):
    """The MLP's up half (gate and up products, their rank-r up-adds, SwiGLU) as the library runs
    it (two ``torch.mm``, two ``lora_rank_up_add_``, ``swiglu_forward``) and as one probe kernel
    with the adds and SwiGLU in the epilogue (``gate_up_swiglu``): ``(current, {name: fused})``,
    the fused kernel whole (its outputs checked against the library's) and, timed only, without
    its rank-r terms and without those and the sigmoid."""

    ext = _ext.load_cpp()
    fan_in, inter = SHAPES["gate/up fwd 576->1536"]
    x = torch.randn(M, fan_in).to(torch.bfloat16)
    wg, wu = (torch.randn(inter, fan_in).to(torch.bfloat16) for _ in range(2))
    bg, bu = (torch.randn(inter, rank) * 0.05 for _ in range(2))  # fp32 adapters (PEFT's default)
    xa = torch.randn(M, 2 * rank)  # [xa_g | xa_u], as the stacked A product leaves it
    packed = [probe.pack_wt(w.t().contiguous()) for w in (wg, wu)]
    bgt, but = bg.t().contiguous(), bu.t().contiguous()

    def current():
        gate, up = torch.mm(x, wg.t()), torch.mm(x, wu.t())
        ext.lora_rank_up_add_(gate, xa[:, :rank], bg, 2.0)
        ext.lora_rank_up_add_(up, xa[:, rank:], bu, 2.0)
        return gate, up, ext.swiglu_forward(gate, up)

    def fused(skip: int = 0):
        return lambda: probe.gate_up_swiglu(x, *packed, xa, bgt, but, 2.0, 64, skip)

    for want, got, name in zip(current(), fused()(), ("gate", "up", "h")):
        # the products sum in another order, so a rounding may land one bf16 step (2^-7
        # relative) away, rarely (~3e-5 of gate's elements); a wrong term moves most of them
        want, got = want.float(), got.float()
        off = ((got - want).abs() > 2**-7 * want.abs()).float().mean().item()
        assert off < 1e-3, f"fused {name}: {off:.2%} of elements differ from the library's"
    return current, {"fused": fused(), "without its rank-r terms": fused(1),
                     "without those and the sigmoid": fused(2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = p.parse_args(argv)
    if "amx_bf16" not in hardware.cpu_flags():
        print("brgemm's bf16 packing needs AMX; this CPU has none: nothing to measure")
        return 1
    probe = load_probe()
    if not probe.available():
        print("this torch build's oneDNN does not pack bf16 for brgemm: nothing to measure")
        return 1
    heap.reuse_freed_buffers_up_to(heap.TRAINING_BYTES)  # as in training: C is not page-faulted
    torch.manual_seed(0)
    print(f"{M} rows, bf16, load {os.getloadavg()[0]:.2f}; ratio = torch.mm / ours (> 1: ours "
          f"faster), median of {args.repeats} back-to-back pairs")  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape, (fan_in, fan_out) in SHAPES.items():
            fns = cases(probe, fan_in, fan_out)
            reference = fns.pop("reference")
            row = [f"{name} {paired_ratio(reference, fn, args.repeats):.2f}"
                   for name, fn in fns.items()]  # fmt: skip
            print(f"{threads} thread(s), {shape}: " + ", ".join(row), flush=True)
        current, fused = fused_case(probe)
        row = [f"{name} {paired_ratio(current, fn, args.repeats):.2f}"
               for name, fn in fused.items()]  # fmt: skip
        head = f"{threads} thread(s), gate/up + rank-r up-adds + SwiGLU, library / "
        print(head + ", ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
