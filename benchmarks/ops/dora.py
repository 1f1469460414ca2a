"""One DoRA linear layer, forward + backward: stock PEFT DoRA (``use_dora=True``) vs lorafuse's
fused DoRA op (``lorafuse.ops.dora``) on the torch and C++ backends, interleaved call by call.

Shapes: SmolLM2-135M's q (576 -> 576), gate (576 -> 1536) and down (1536 -> 576) projections, r
16, ``--tokens`` rows. The saved-for-backward column is the bytes autograd keeps per call
(``saved_tensors_hooks``, unique storages, frozen weights and parameters excluded).

    python benchmarks/ops/dora.py [--tokens 512] [--iters 7] [--dtype fp32] [--threads 1]
"""

from __future__ import annotations

import argparse

import peft
import torch
from torch import nn

from lorafuse import backends
from lorafuse.ops.dora import dora_linear
from lorafuse.testing import saved_bytes
from lorafuse.testing.timing import interleaved_medians

SHAPES = {"q_proj": (576, 576), "gate_proj": (576, 1536), "down_proj": (1536, 576)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _stock_layer(d, k, r, dtype):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(d, k, bias=False)).to(dtype)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], use_dora=True)
    layer = peft.get_peft_model(base, cfg).base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.02)  # PEFT's zero B: a trivial norm
    return layer


def _steps(layer, x, g):
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    m = layer.lora_magnitude_vector["default"].weight
    w, s = layer.base_layer.weight, layer.scaling["default"]
    params = [w, A, B, m]

    def stock():
        layer(x).backward(g)

    def fused(backend):
        return lambda: dora_linear(x, w, None, A, B, m, s, backend=backend).backward(g)

    steps = {"stock": stock, "torch": fused("torch")}
    if backends.cpp_available():
        steps["cpp"] = fused("cpp")
    return steps, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(f"DoRA linear fwd+bwd, {args.tokens} tokens, r={args.rank}, {args.dtype}, "
          f"{args.threads} thread(s); median ms of {args.iters} interleaved calls")  # fmt: skip
    print(f"{'shape':>22} {'impl':>6} {'ms':>8} {'stock/ours':>10} {'saved MiB':>10}")
    for name, (d, k) in SHAPES.items():
        layer = _stock_layer(d, k, args.rank, dtype)
        x = torch.randn(args.tokens, d, dtype=dtype, requires_grad=True)
        g = torch.randn(args.tokens, k, dtype=dtype)
        steps, params = _steps(layer, x, g)
        times = interleaved_medians(steps, args.iters)
        for impl in steps:
            nbytes = _saved(layer, x, impl, params)
            ratio = times["stock"] / times[impl]
            print(f"{name + f' {d}->{k}':>22} {impl:>6} {times[impl] * 1e3:8.2f} {ratio:9.2f}x "
                  f"{nbytes / 2**20:10.2f}")  # fmt: skip


def _saved(layer, x, impl, params) -> int:
    """Bytes autograd saves for one forward of ``impl`` (parameters excluded)."""
    w, A, B, m = params

    def forward():
        if impl == "stock":
            return layer(x)
        return dora_linear(x, w, None, A, B, m, layer.scaling["default"], backend=impl)

    return saved_bytes(forward, params)[0]


if __name__ == "__main__":
    main()
