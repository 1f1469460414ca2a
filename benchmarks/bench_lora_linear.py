"""One LoRA linear layer, forward + backward: stock PEFT ``lora.Linear`` vs lorafuse's fused op
on every backend available here, in one run.

Shapes: d=k=768 r=8 and d=k=2048/4096 r=16, tokens = batch*seq (4 x 512 in fp32). bf16 uses
fewer tokens by default (``--bf16-tokens``): on an AVX2-only CPU stock bf16 GEMMs run ~100x slower
than fp32, so 2048 tokens at d=4096 would take minutes per call.

Memory: activation memory is what a LoRA layer adds to training, so the CPU column is the bytes
saved for backward (``torch.autograd.graph.saved_tensors_hooks``, unique storages, frozen weights
excluded): exact and independent of the allocator. On CUDA the peak of
``torch.cuda.max_memory_allocated`` above the inputs is reported as well.

    python benchmarks/bench_lora_linear.py [--dtypes fp32,bf16] [--iters 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import peft
import torch
from torch import nn

from lorafuse import backends
from lorafuse.ops.lora_linear import lora_linear

SHAPES = [(768, 8), (2048, 16), (4096, 16)]  # (d = k, r)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _stock_layer(d, r, dtype, device):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(d, d, bias=False)).to(dtype=dtype, device=device)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"]))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.02)  # PEFT's zero B would be a trivial case
    return layer


def _saved_bytes(fn, params) -> tuple[int, torch.Tensor]:
    """Bytes of unique tensor storages autograd saves while running ``fn``, excluding the
    storages of ``params`` (weights are resident anyway; saving a reference costs nothing)."""
    resident = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in resident:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _time(step, iters, warmup, device) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _case(d, r, n, dtype, device, iters, warmup) -> list[dict]:
    layer = _stock_layer(d, r, dtype, device)
    W = layer.base_layer.weight
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    s = float(layer.scaling["default"])
    x = torch.randn(n, d, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(n, d, dtype=dtype, device=device)
    runs = {"stock PEFT": lambda: layer(x)}
    for b in ("torch", "cpp", "triton"):
        try:
            if backends.select("lora_linear", device, b) == b:
                runs[f"lorafuse[{b}]"] = lambda b=b: lora_linear(x, W, None, A, B, s, 0.0, True, b)
        except backends.BackendError:
            pass
    rows = []
    for name, fwd in runs.items():
        saved, y = _saved_bytes(fwd, list(layer.parameters()))
        y.backward(g)

        def step(fwd=fwd):
            x.grad = A.grad = B.grad = None
            fwd().backward(g)

        peak = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        t = _time(step, iters, warmup, device)
        rows.append({"impl": name, "d": d, "r": r, "tokens": n, "dtype": str(dtype).split(".")[-1],
                     "ms": 1e3 * t, "saved_mib": saved / 2**20, "cuda_peak_mib": peak})  # fmt: skip
    ref = rows[0]["ms"]
    for row in rows:
        row["speedup"] = ref / row["ms"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--tokens", type=int, default=4 * 512, help="batch*seq for fp32")
    p.add_argument("--bf16-tokens", type=int, default=128, help="batch*seq for bf16 (see above)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    rows = []
    hdr = f"{'dtype':>5} {'d':>5} {'r':>3} {'tokens':>6} {'impl':>17} {'ms':>9} {'x stock':>8} {'saved MiB':>10}"
    print(hdr)
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        n = args.tokens if dtype == torch.float32 else args.bf16_tokens
        for d, r in SHAPES:
            for row in _case(d, r, n, dtype, device, args.iters, args.warmup):
                rows.append(row)
                print(f"{name:>5} {d:>5} {r:>3} {n:>6} {row['impl']:>17} {row['ms']:>9.2f} "
                      f"{row['speedup']:>7.2f}x {row['saved_mib']:>10.2f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
