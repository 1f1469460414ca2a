"""One LoRA Conv2d layer, forward + backward: the unfused kohya module's math (plain autograd)
vs lorafuse's ``lora_conv2d`` on every backend available here, in one run.

Shapes are Stable Diffusion 1.5's UNet convs at 512x512 (latents 64x64), batch 1: the 3x3
ResNet convs at each level (320 @ 64x64 ... 1280 @ 8x8), a 1x1 ``proj_in`` and the stride-2
``Downsample2D``, with kohya ranks (``conv_dim``) 8/32/128. Times are medians of interleaved
repeats (each repeat runs every implementation once, in turn), so a busy machine slows all of
them alike. ``saved MiB`` is what autograd keeps for backward (unique storages, frozen weight
and adapters excluded), exact and independent of the allocator.

    python benchmarks/ops/lora_conv.py [--dtype fp32|bf16] [--adapter fp32] [--repeats 7]
        [--shapes 0,5] [--json out.json]
"""

from __future__ import annotations

import argparse

import torch

from lorafuse import backends
from lorafuse.files import write_json
from lorafuse.ops.lora_conv import lora_conv2d, lora_conv2d_reference
from lorafuse.testing import saved_bytes
from lorafuse.testing.timing import interleaved_medians

# (name, N, C, H=W, kernel, stride, r)
SHAPES = [
    ("res 320@64", 1, 320, 64, 3, 1, 8),
    ("res 320@64", 1, 320, 64, 3, 1, 32),
    ("res 320@64", 1, 320, 64, 3, 1, 128),
    ("proj_in 320@64", 1, 320, 64, 1, 1, 32),
    ("down 320@64", 1, 320, 64, 3, 2, 32),
    ("res 640@32", 1, 640, 32, 3, 1, 32),
    ("res 1280@16", 1, 1280, 16, 3, 1, 32),
    ("res 1280@8", 1, 1280, 8, 3, 1, 8),
    ("res 1280@8", 1, 1280, 8, 3, 1, 128),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _case(shape, dtype, adapter, device, repeats) -> list[dict]:
    name, n, c, hw, k, stride, r = shape
    gen = torch.Generator().manual_seed(0)
    fan = c * k * k

    def rn(*s, std=1.0, dt=dtype):
        return (torch.randn(*s, generator=gen) * std).to(device, dt)

    x = rn(n, c, hw, hw).requires_grad_(True)
    w = rn(c, c, k, k, std=fan**-0.5)
    b = rn(c, std=0.1)
    down = rn(r, c, k, k, std=fan**-0.5, dt=adapter).requires_grad_(True)
    up = rn(c, r, 1, 1, std=0.02, dt=adapter).requires_grad_(True)
    pad = k // 2
    g = rn(n, c, (hw + 2 * pad - k) // stride + 1, (hw + 2 * pad - k) // stride + 1)
    runs = {"unfused": lambda: lora_conv2d_reference(x, w, b, down, up, 1.0, stride, pad)}
    for bk in ("torch", "cpp", "triton"):
        try:
            if backends.select("lora_conv2d", device, bk) == bk:
                runs[f"lorafuse[{bk}]"] = lambda bk=bk: lora_conv2d(
                    x, w, b, down, up, 1.0, stride, pad, backend=bk
                )
        except backends.BackendError:
            pass
    steps, saved = {}, {}
    for impl, fwd in runs.items():
        saved[impl], y = saved_bytes(fwd, [w, b, down, up])
        y.backward(g)  # warm-up (oneDNN primitive creation)

        def step(fwd=fwd):
            x.grad = down.grad = up.grad = None
            fwd().backward(g)

        steps[impl] = step
    # interleaved: every implementation once per repeat; warmed up above
    med = interleaved_medians(steps, repeats, warmup=0, device=device)
    base = med["unfused"]
    rows = []
    for impl in runs:
        ms = 1e3 * med[impl]
        rows.append({"shape": name, "N": n, "C": c, "HW": hw, "k": k, "stride": stride, "r": r,
                     "dtype": str(dtype).split(".")[-1], "adapter": str(adapter).split(".")[-1],
                     "impl": impl, "ms": ms,
                     "speedup": 1e3 * base / ms, "saved_mib": saved[impl] / 2**20})  # fmt: skip
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--adapter", default=None, choices=sorted(DTYPES),
                   help="adapter dtype (default: --dtype); fp32 adapters on a bf16 base")  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    chosen = SHAPES if not args.shapes else [SHAPES[int(i)] for i in args.shapes.split(",")]
    adapter = DTYPES[args.adapter or args.dtype]
    print(f"torch threads {torch.get_num_threads()}, {args.dtype} base, {adapter} adapters, "
          f"{args.repeats} repeats")  # fmt: skip
    print(f"{'shape':>15} {'k':>2} {'s':>2} {'r':>4} {'impl':>16} {'ms':>9} {'x unfused':>9} "
          f"{'saved MiB':>10}")  # fmt: skip
    rows = []
    for shape in chosen:
        for row in _case(shape, DTYPES[args.dtype], adapter, device, args.repeats):
            rows.append(row)
            print(f"{row['shape']:>15} {row['k']:>2} {row['stride']:>2} {row['r']:>4} "
                  f"{row['impl']:>16} {row['ms']:>9.2f} {row['speedup']:>8.2f}x "
                  f"{row['saved_mib']:>10.2f}", flush=True)  # fmt: skip
    if args.json:
        write_json(args.json, rows)  # atomic


if __name__ == "__main__":
    main()
