"""Question: which bf16 product should the CPU kernels call: sgemm, MKL's bf16 GEMM or brgemm?
Answer: oneDNN's brgemm, 199-230 GFLOP/s against MKL's 58-93 and sgemm's 67-96 (1 thread,
2-core AMD EPYC with AVX-512-BF16 and no AMX).
Constant: ``pack_panel`` (src/lorafuse/csrc/attention_products.h: brgemm wherever oneDNN has a
bf16 micro-kernel) and ``bf16x3_allowed`` (src/lorafuse/csrc/lora_rank_bf16x3.cpp: AMX only).

The causal attention kernel multiplies its bf16 blocks through oneDNN's brgemm micro-kernel or
MKL's ``cblas_gemm_bf16bf16f32``; the rank-r "bf16x3" products through MKL's (``csrc/``). How fast
each is depends on the CPU: where MKL's bf16 GEMM runs no faster than sgemm (seen on an AMD EPYC
with AVX-512-BF16), bf16x3's three products lose to one fp32 FMA pass. This times, on one thread
(the kernels call them inside their own parallel regions), at the kernels' shapes:

* ``sgemm``: BLAS on fp32 copies of the operands (the fp32 baseline);
* ``mkl``: MKL's bf16 GEMM on the bf16 operands as stored;
* ``brgemm``: oneDNN's micro-kernel on B in its VNNI layout (packed outside the timing, as the
  attention kernel packs K and V once per call), by panels of 64 columns.

Each result is checked against an fp32 product first. Printed: microseconds per call (median of
``--repeats`` interleaved rounds), GFLOP/s, and each one's speed against sgemm.

    python benchmarks/probes/bf16_products.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

KINDS = ("sgemm", "mkl", "brgemm")
SHAPES = {  # name: (m, k, n), C (m x n) = A (m x k) · B (k x n)
    "attention S = Q·Kᵀ 192x64x512": (192, 64, 512),
    "attention O = P·V 192x512x64": (192, 512, 64),
    "bf16x3 xa = x·[A1 A2 A3]ᵀ 2048x576x48": (2048, 576, 48),
    "bf16x3 dB = gᵀ·[xa1 xa2 xa3] 1536x2048x48": (1536, 2048, 48),
}


def load_probe():
    from torch.utils.cpp_extension import load

    from lorafuse import _ext

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bf16_products.cpp")
    return load("lorafuse_bf16_products_probe", [src], extra_cflags=_ext.compile_flags())


def operands(m: int, k: int, n: int):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(k, n, generator=g).bfloat16()
    w = min(n, 64)  # VNNI panels: (n / w, k / 2, w, 2)
    b_vnni = b.view(k // 2, 2, n // w, w).permute(2, 0, 3, 1).contiguous()
    return a, b, b_vnni, a.float(), b.float()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds per shape")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    probe = load_probe()
    kinds = [kind for kind in KINDS if probe.available(kind)]
    if "sgemm" not in kinds:
        print("this torch build exports no BLAS sgemm_: nothing to compare against")
        return 1
    print(f"1 thread; oneDNN packs bf16 (AMX): {probe.could_pack()}; load {os.getloadavg()[0]:.2f}")
    print(f"{'shape':<44}" + "".join(f"{kind + ' us':>12}{'GF/s':>7}" for kind in kinds)
          + "".join(f"{kind + '/sgemm':>13}" for kind in kinds[1:]))  # fmt: skip
    for name, (m, k, n) in SHAPES.items():
        ops = operands(m, k, n)
        want = ops[3] @ ops[4]
        reps = max(1, int(2e8 / (2 * m * k * n)))  # ~1 ms of work per timing at 200 GFLOP/s
        for kind in kinds:
            got = probe.run(kind, *ops, 1)[1]
            err = float((got - want).abs().max()) / float(want.abs().max())
            if err > 1e-5:  # bf16·bf16 products are exact in fp32: only the summation order
                print(f"{kind} is wrong at {name}: relative error {err:.2e}")
                return 1
        times = {kind: [] for kind in kinds}
        for _ in range(args.repeats):
            for kind in kinds:
                times[kind].append(probe.run(kind, *ops, reps)[0])
        med = {kind: statistics.median(ts) for kind, ts in times.items()}
        flops = 2.0 * m * k * n
        row = "".join(f"{med[kind] * 1e6:>12.1f}{flops / med[kind] / 1e9:>7.0f}" for kind in kinds)
        ratios = "".join(f"{med['sgemm'] / med[kind]:>12.2f}x" for kind in kinds[1:])
        print(f"{name:<44}{row}{ratios}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
