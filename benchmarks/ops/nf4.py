"""NF4 dequantisation on CPU: the C++ kernel vs lorafuse's torch code, on Llama-3.2-1B's shapes.

Each shape (out, in) is quantised once; both dequantisers then produce the dense weight in the
output dtype (a fresh tensor per call, as :meth:`NF4Weight.dequantize` does in training), and
their outputs are checked bit for bit first. Time: the median of ``--repeats`` calls after one
warmup, interleaved; ratio = torch / C++ (> 1: C++ faster). For scale, the bf16 GEMM the weight
feeds at 512 tokens (``x (512, in) @ Wᵀ``) is timed too: dequantisation runs twice per weight
per training step (forward and backward), next to two such products. These numbers decide
whether ``nf4_dequantize`` is in ``backends.CPP_DEFAULT``.

    python benchmarks/ops/nf4.py [--threads 2] [--repeats 7] [--tokens 512] [--json out.json]

``--decode``: one token's product through a ``Linear4bit`` (1 row, inference mode) straight from
the codes (``csrc/decode_linear.cpp``; on AVX-512 dequantised in registers) vs the kernel's tile
body (``simd=False``: a tile of rows dequantised into a buffer, what other CPUs run) vs
dequantise-then-multiply (``ops.nf4.DECODE_MAX_ROWS = 0``), and the same product on a dense bf16
``nn.Linear`` for scale; ``--layers`` distinct copies per shape are cycled so that, as in
decoding, the weights are not in cache. ratio = dequantise / codes (> 1: decoding from the codes
is faster).

    python benchmarks/ops/nf4.py --decode [--threads 1] [--repeats 7] [--layers 16]
"""

from __future__ import annotations

import argparse
import os

import torch

from lorafuse import backends
from lorafuse.files import write_json
from lorafuse.models import nf4
from lorafuse.ops import nf4 as nf4_ops
from lorafuse.testing.timing import interleaved_medians

SHAPES = {"q_proj/o_proj": (2048, 2048), "k_proj/v_proj": (512, 2048), "gate/up": (8192, 2048),
          "down_proj": (2048, 8192)}  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def bench_shape(shape, dtype, repeats: int, tokens: int) -> dict:
    w = torch.randn(shape) * 0.02
    buf = nf4_ops.quantize_nf4(w)
    (cpp,) = backends.compiled("nf4_dequantize", "cpp", "forward")

    def run_cpp():
        out = torch.empty(shape, dtype=dtype)
        cpp(buf["codes"], buf["absmax_q"], buf["absmax_scale"], buf["absmax_offset"], out)
        return out

    def run_torch():
        return nf4_ops.dequantize_nf4(**buf, shape=shape, dtype=dtype)

    if not torch.equal(run_cpp(), run_torch()):
        raise SystemExit(f"C++ and torch NF4 dequantisation differ at {shape} {dtype}")
    x, dense = torch.randn(tokens, shape[1], dtype=dtype), run_torch()
    t = interleaved_medians(
        {"torch": run_torch, "cpp": run_cpp, "gemm": lambda: x @ dense.T}, repeats
    )
    return {"torch_ms": t["torch"] * 1e3, "cpp_ms": t["cpp"] * 1e3, "gemm_ms": t["gemm"] * 1e3,
            "ratio": t["torch"] / t["cpp"], "gelem_per_s": shape[0] * shape[1] / t["cpp"] / 1e9}  # fmt: skip


def bench_decode(shape, layers: int, repeats: int) -> dict:
    """ms per layer for one row: NF4 from the codes, by the tile body, dequantise-then-multiply,
    dense bf16."""
    bf = torch.bfloat16
    dense = [torch.nn.Linear(shape[1], shape[0], bias=False, dtype=bf) for _ in range(layers)]
    quant = [nf4.Linear4bit(lin, bf) for lin in dense]
    x = torch.randn(1, shape[1], dtype=bf)

    def run(mods, max_rows=nf4_ops.DECODE_MAX_ROWS):
        def f():
            previous, nf4_ops.DECODE_MAX_ROWS = nf4_ops.DECODE_MAX_ROWS, max_rows
            try:
                with torch.inference_mode():
                    for m in mods:
                        m(x)
            finally:
                nf4_ops.DECODE_MAX_ROWS = previous

        return f

    with torch.inference_mode():  # fp32 sums in another order: equal up to one bf16 rounding
        ours, ref = quant[0](x).float(), x.float() @ quant[0].weight.dequantize(bf).float().T
        if not torch.allclose(ours, ref, rtol=2**-8, atol=1e-6):
            raise SystemExit(f"decoding from the codes differs from the dense path at {shape}")
    (kernel,) = backends.compiled("nf4", "cpp", "decode_linear")

    def tiles():  # the kernel's tile body (simd=False), called directly
        with torch.inference_mode():
            for m in quant:
                w = m.weight
                kernel(x, w.codes, w.absmax_q, w.absmax_scale, w.absmax_offset, shape[0], None,
                       False)  # fmt: skip

    fns = {"codes": run(quant), "tiles": tiles, "dequantise": run(quant, 0), "bf16": run(dense)}
    t = interleaved_medians(fns, repeats)
    ms = {k: v * 1e3 / layers for k, v in t.items()}
    return {**{f"{k}_ms": v for k, v in ms.items()}, "ratio": ms["dequantise"] / ms["codes"]}


def main_decode(args) -> None:
    print(f"decode: threads {args.threads}, load {os.getloadavg()[0]:.1f}, median of "
          f"{args.repeats}, {args.layers} layers per shape, 1 row, bf16")  # fmt: skip
    print(f"{'weight':>14} {'shape':>11} {'codes ms':>9} {'tiles ms':>9} {'dequant ms':>10} "
          f"{'ratio':>6} {'bf16 ms':>8}")  # fmt: skip
    for wname, shape in SHAPES.items():
        r = bench_decode(shape, args.layers, args.repeats)
        print(f"{wname:>14} {shape[0]:>5}x{shape[1]:<5} {r['codes_ms']:9.3f} {r['tiles_ms']:9.3f} "
              f"{r['dequantise_ms']:10.3f} {r['ratio']:5.2f}x {r['bf16_ms']:8.3f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=512, help="rows of the GEMM timed for scale")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--decode", action="store_true", help="time one-row products (decoding)")
    ap.add_argument("--layers", type=int, default=16, help="--decode: copies per shape")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not backends.cpp_available():
        raise SystemExit("the C++ extension is unavailable here (see the warning above)")
    if args.decode:
        return main_decode(args)
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.1f}, median of {args.repeats}")
    head = f"{'weight':>14} {'shape':>11} {'dtype':>5} {'torch ms':>9} {'C++ ms':>7} "
    print(head + f"{'torch/C++':>9} {'C++ Gelem/s':>11} {'GEMM ms':>8} {'C++/GEMM':>8}")
    results = []
    for dname in args.dtypes:
        for wname, shape in SHAPES.items():
            r = bench_shape(shape, DTYPES[dname], args.repeats, args.tokens)
            results.append({"weight": wname, "shape": list(shape), "dtype": dname, **r})
            print(f"{wname:>14} {shape[0]:>5}x{shape[1]:<5} {dname:>5} {r['torch_ms']:9.2f} "
                  f"{r['cpp_ms']:7.2f} {r['ratio']:8.1f}x {r['gelem_per_s']:11.2f} "
                  f"{r['gemm_ms']:8.2f} {r['cpp_ms'] / r['gemm_ms']:8.2f}")  # fmt: skip
    if args.json:
        write_json(args.json, {"threads": args.threads, "results": results})  # atomic


if __name__ == "__main__":
    main()
