"""One LoRA linear layer, forward + backward: stock PEFT ``lora.Linear`` vs lorafuse's fused op
on every backend available here, in one run.

Shapes: d=k=768 r=8 and d=k=2048/4096 r=16, tokens = batch*seq (4 x 512 in fp32). bf16 uses
fewer tokens by default (``--bf16-tokens``): on an AVX2-only CPU stock bf16 GEMMs run ~100x slower
than fp32, so 2048 tokens at d=4096 would take minutes per call.

Memory: activation memory is what a LoRA layer adds to training, so the CPU column is the bytes
saved for backward (``torch.autograd.graph.saved_tensors_hooks``, unique storages, frozen weights
excluded): exact and independent of the allocator. On CUDA the peak of
``torch.cuda.max_memory_allocated`` above the inputs is reported as well.

    python benchmarks/ops/lora_linear.py [--dtypes fp32,bf16] [--iters 5] [--json out.json]

``--sd15-targets RES`` instead times the 192 kohya targets of an SD1.5 UNet training step at
RES px (batch 1, fp32, one thread), one row per distinct shape (count = how many of the 192
have it): N = tokens at that level, d = 320/640/1280; attention q/k/v/out (attn2's k/v take the
77x768 text states, which need no input gradient), ff.net.0.proj (d -> 8d), ff.net.2 (4d -> d),
and proj_in/proj_out as 1x1 convs. Each is timed forward + backward (the input gradient where a
training step needs it, dA and dB) three ways, interleaved call by call: the frozen layer alone,
kohya's unfused ``org(x) + up(down(x)) * scale`` and lorafuse's op (backend ``auto``), in
process CPU time (one thread: the wall time of an idle machine, without preemptions). The
overhead columns are each minus the frozen layer's time; the totals weight rows by count, i.e.
what the LoRA layers add to one step (AdamW and the rest of the UNet excluded). The
``products`` column times the branch's six rank-r products alone (``torch.mm`` into preallocated
outputs): the arithmetic no LoRA implementation avoids, i.e. the floor of its overhead:

    python benchmarks/ops/lora_linear.py --sd15-targets 128 --ranks 8,128 --iters 60
"""

from __future__ import annotations

import argparse
import time

import peft
import torch
from torch import nn

from lorafuse import backends
from lorafuse.files import write_json
from lorafuse.ops.lora_linear import lora_linear
from lorafuse.testing import saved_bytes
from lorafuse.testing.timing import interleaved_medians, median_time

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
        saved, y = saved_bytes(fwd, list(layer.parameters()))
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
        t = median_time(step, iters, warmup, device=device)
        rows.append({"impl": name, "d": d, "r": r, "tokens": n, "dtype": str(dtype).split(".")[-1],
                     "ms": 1e3 * t, "saved_mib": saved / 2**20, "cuda_peak_mib": peak})  # fmt: skip
    ref = rows[0]["ms"]
    for row in rows:
        row["speedup"] = ref / row["ms"]
    return rows


def sd15_targets(res: int):
    """(kind, tokens N, d_in, d_out, input needs grad, latent side, count, name) for each
    distinct shape among SD1.5's 192 kohya targets at ``res`` px, batch 1."""
    side = res // 8
    # (channels, latent side at that level, transformer blocks there): down 2 + up 3 at the
    # first three levels (down_blocks[2]/up_blocks[1] share 1280 @ side/4), mid 1 at side/8
    for c, s, blocks in ((320, side, 5), (640, side // 2, 5), (1280, side // 4, 5),
                         (1280, side // 8, 1)):  # fmt: skip
        n = s * s
        yield "conv", n, c, c, True, s, 2 * blocks, f"proj_in/out {c} @{s}x{s}"
        yield "linear", n, c, c, True, s, 6 * blocks, f"attn q/k/v/out {c} N={n}"
        yield "linear", 77, 768, c, False, s, 2 * blocks, f"attn2 k/v 77x768->{c}"
        yield "linear", n, c, 8 * c, True, s, blocks, f"ff0 {c}->{8 * c} N={n}"
        yield "linear", n, 4 * c, c, True, s, blocks, f"ff2 {4 * c}->{c} N={n}"


def _rank_products(n, d, k, r, x_grad, gen):
    """The LoRA branch's rank-r products alone, each ``torch.mm`` of contiguous fp32 operands
    into a preallocated output (the roofline's convention): x·Aᵀ (n,d,r), xa·Bᵀ (n,r,k),
    g·B (n,k,r), gᵀ·xa (k,n,r), gBᵀ·x (r,n,d), and gB·A (n,r,d) where the input gradient is
    needed. No implementation of the branch does less arithmetic, so their time is the floor
    of any LoRA overhead at this shape (a fused op saves the passes and calls around them)."""
    shapes = [(n, d, r), (n, r, k), (n, k, r), (k, n, r), (r, n, d)] + [(n, r, d)] * x_grad
    ops = [(torch.randn(m, kk, generator=gen), torch.randn(kk, nn_, generator=gen),
            torch.empty(m, nn_)) for m, kk, nn_ in shapes]  # fmt: skip

    def run():
        for a, b_, out in ops:
            torch.mm(a, b_, out=out)

    return run


def _target_case(kind, n, d, k, x_grad, side, r, iters) -> dict:
    import torch.nn.functional as F

    from lorafuse.ops.lora_conv import lora_conv2d

    g = torch.Generator().manual_seed(0)
    conv = kind == "conv"
    x_shape, y_shape = ((1, d, side, side), (1, k, side, side)) if conv else ((n, d), (n, k))
    tail = (1, 1) if conv else ()
    x = torch.randn(x_shape, generator=g).requires_grad_(x_grad)
    w = torch.randn(k, d, *tail, generator=g) / d**0.5
    b = torch.randn(k, generator=g)
    down = (torch.randn(r, d, *tail, generator=g) / d**0.5).requires_grad_(True)
    up = (torch.randn(k, r, *tail, generator=g) / r**0.5).requires_grad_(True)
    gy = torch.randn(y_shape, generator=g)
    base, fused = (F.conv2d, lora_conv2d) if conv else (F.linear, lora_linear)
    forwards = {
        "frozen": lambda: base(x, w, b),
        "kohya": lambda: base(x, w, b) + base(base(x, down), up) * 1.0,
        "lorafuse": lambda: fused(x, w, b, down, up, 1.0),
        "products": _rank_products(n, d, k, r, x_grad, g),
    }

    def step(fwd):
        y = fwd()
        if y is not None and y.requires_grad:  # frozen on text states: nothing to backpropagate
            y.backward(gy)
        x.grad = down.grad = up.grad = None

    # interleaved call by call: a load change hits all of them alike. CPU time: a preemption (one
    # 4-13 ms time slice on a busy box, as long as the call itself) does not count; 1 thread = wall
    steps = {name: lambda fwd=fwd: step(fwd) for name, fwd in forwards.items()}
    times = interleaved_medians(steps, iters, clock=time.process_time)
    return {name: 1e6 * t for name, t in times.items()}


def run_sd15_targets(res: int, ranks: list[int], iters: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for r in ranks:
        total = {"frozen": 0.0, "kohya": 0.0, "lorafuse": 0.0, "products": 0.0}
        print(f"SD1.5 targets at {res} px, r={r}: fwd+bwd us per call (median of {iters})")
        for kind, n, d, k, x_grad, side, count, name in sd15_targets(res):
            us = _target_case(kind, n, d, k, x_grad, side, r, iters)
            for c in total:
                total[c] += count * us[c] / 1e3
            ovh_k, ovh_o = us["kohya"] - us["frozen"], us["lorafuse"] - us["frozen"]
            rows.append({"res": res, "r": r, "name": name, "count": count, **us})
            print(f"  {name:28s} x{count:<3d} frozen {us['frozen']:7.0f}  kohya {us['kohya']:7.0f}"
                  f"  lorafuse {us['lorafuse']:7.0f}  ovh kohya {ovh_k:6.0f}  ours {ovh_o:6.0f}"
                  f"  products {us['products']:6.0f}", flush=True)  # fmt: skip
        ovh_k, ovh_o = total["kohya"] - total["frozen"], total["lorafuse"] - total["frozen"]
        floor = total["products"]
        print(
            f"  all 192 per step: frozen {total['frozen']:.1f} ms, LoRA overhead kohya "
            f"{ovh_k:.1f} ms, lorafuse {ovh_o:.1f} ms (ours/kohya {ovh_o / ovh_k:.2f}); "
            f"rank-r products alone {floor:.1f} ms = {floor / ovh_k:.2f} of kohya's overhead"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sd15-targets",
        type=int,
        default=None,
        metavar="RES",
        help="time SD1.5's 192 LoRA targets at RES px instead (see above)",
    )
    p.add_argument("--ranks", default="8,128", help="with --sd15-targets")  # fmt: skip
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--tokens", type=int, default=4 * 512, help="batch*seq for fp32")
    p.add_argument("--bf16-tokens", type=int, default=128, help="batch*seq for bf16 (see above)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.sd15_targets:
        ranks = [int(r) for r in args.ranks.split(",")]
        rows = run_sd15_targets(args.sd15_targets, ranks, args.iters)
        if args.json:
            write_json(args.json, rows)
        return
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
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
