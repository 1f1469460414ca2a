"""Question: how large should one dense tile of an NF4 projection be in the fused ops?
Answer: 4 MiB: whole / tiled MLP 0.93x, Q/K/V 0.96x (2 MiB 0.85x / 0.91x; 8 MiB no faster in
the step, 12 MiB more peak) (Llama-3.2-1B, 2 threads, 2-core AMD EPYC).
Constant: ``ops.weights.TILE_BYTES`` (src/lorafuse/ops/weights.py).

QLoRA's fused ops with NF4 base weights in tiles vs one dense copy, on Llama-3.2-1B's shapes.

The fused MLP (gate/up/down, 8192 x 2048) and Q/K/V (2048 / 512 / 512 x 2048) run forward +
backward on ``--tokens`` rows, bf16 base in NF4, PEFT's fp32 adapters (r = 16), once with every
weight dequantized whole (``ops.weights.TILE_BYTES`` past every weight: the fused
``lora_linear`` kernels) and once per tile size (``--tiles`` MiB: the split path of
``ops/lora_split.py``, rows in forward, columns in backward), with lorafuse's large-buffer
allocator installed as patching installs it. Printed: the median time of
``--repeats`` interleaved rounds, the ratio whole / tiled (> 1: tiles faster) and the largest
dense copy alive (what the tiles save at the step's peak). Timing only; the equivalence is
``tests/models/test_nf4_tiles.py``'s.

    python benchmarks/probes/nf4_tiles.py [--threads 2] [--repeats 7] [--tokens 512] [--tiles 2 4 8 16]
"""

from __future__ import annotations

import argparse

import torch

from lorafuse import heap
from lorafuse.models import nf4
from lorafuse.ops import weights
from lorafuse.ops.lora_mlp import LoRAParams, lora_mlp
from lorafuse.ops.lora_qkv import lora_qkv
from lorafuse.testing import interleaved_medians, nf4_dense_copies

D, INTER, KV = 2048, 8192, 512
WHOLE = 1 << 40  # TILE_BYTES past every weight: no tiles


def _proj(d_in: int, d_out: int, r: int = 16) -> LoRAParams:
    w = torch.randn(d_out, d_in) * 0.02
    q = nf4.NF4Weight(**nf4.quantize_nf4(w), shape=w.shape, dtype=torch.bfloat16)
    A = (torch.randn(r, d_in) / d_in**0.5).requires_grad_(True)
    B = (torch.randn(d_out, r) * 0.01).requires_grad_(True)
    return LoRAParams(q, None, A, B, 1.0, 0.0)


def _step(op, x, params, g):
    def run():
        x.grad = None
        outs = op(x, *params)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [g[: o.shape[-1]].expand_as(o) for o in outs])

    return run


def _largest_copy(fn) -> int:
    """Bytes of the largest dense copy an NF4 weight hands out during ``fn()``."""
    with nf4_dense_copies() as sizes:
        fn()
    return max(sizes, default=0)


def with_tiles(nbytes: int, fn):
    def run():
        weights.TILE_BYTES = nbytes
        fn()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--tiles", type=int, nargs="+", default=[2, 4, 8, 16], help="MiB")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    heap.use_large_buffers()  # as patch_peft_model does on CPU: freed buffers reused by size
    torch.manual_seed(0)
    x = torch.randn(args.tokens, D, dtype=torch.bfloat16).requires_grad_(True)
    g = torch.randn(INTER, dtype=torch.bfloat16) * 0.01
    ops = {
        "mlp": (lora_mlp, [_proj(D, INTER), _proj(D, INTER), _proj(INTER, D)]),
        "qkv": (lora_qkv, [_proj(D, D), _proj(D, KV), _proj(D, KV)]),
    }
    default = weights.TILE_BYTES
    print(f"NF4 bf16 base, fp32 adapters r=16, {args.tokens} tokens, {args.threads} threads, "
          f"medians of {args.repeats}")  # fmt: skip
    for name, (op, params) in ops.items():
        step = _step(op, x, params, g)
        fns = {"whole": with_tiles(WHOLE, step)}
        fns.update({f"{t} MiB": with_tiles(t << 20, step) for t in args.tiles})
        times = interleaved_medians(fns, args.repeats)
        for label, fn in fns.items():
            largest = _largest_copy(fn) / 2**20
            ratio = times["whole"] / times[label]
            print(f"  {name:4s} {label:>7s}: {times[label] * 1e3:8.1f} ms  whole/this {ratio:5.2f}x"
                  f"  largest dense copy {largest:5.1f} MiB")  # fmt: skip
    weights.TILE_BYTES = default


if __name__ == "__main__":
    main()
