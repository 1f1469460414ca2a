"""``lorafuse bench``: training speed of stock transformers + PEFT vs lorafuse, in one run.

The measurement protocol (fresh subprocess per run, interleaved, warmup excluded, peak memory) is
described in :mod:`lorafuse.bench`; this module parses the flags and prints the table.
"""

from __future__ import annotations

import argparse

from lorafuse.bench import CONFIGS, MODELS, compare, format_table, write_json
from lorafuse.errors import LorafuseError


# fmt: off
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, default="llama-4l-1024",
                   help="llama-4l-1024: 4 layers, hidden 1024, 16 heads, intermediate 2816, vocab "
                        "32000; smollm2-135m: the SmolLM2-135M architecture (random weights); "
                        "tiny: 2 layers, hidden 64 (smoke tests)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="measured steps per repeat")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per repeat")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank on all seven projections")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in both")
    p.add_argument("--backend", default=None, help="lorafuse kernels: auto|torch|cpp|triton")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each run")
    p.add_argument("--only", choices=CONFIGS, default=None, help="run one configuration only")
    p.add_argument("--profile", action="store_true",
                   help="after measuring, profile one lorafuse step with torch.profiler")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="skip timing the unavoidable matrix products (roofline efficiency)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
# fmt: on


def _validate(args) -> None:
    for name in ("batch", "seq", "steps", "repeats", "rank"):
        if getattr(args, name) < 1:
            raise LorafuseError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise LorafuseError(f"--warmup must be >= 0, got {args.warmup}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise LorafuseError("--device cuda: no CUDA device is available here")


def run(args: argparse.Namespace) -> int:
    _validate(args)
    from lorafuse import backends

    spec = {k: getattr(args, k) for k in ("model", "dtype", "device", "batch", "seq", "steps",
                                          "warmup", "rank", "grad_ckpt", "backend", "threads")}  # fmt: skip
    results, runs = compare(
        spec, args.repeats, only=args.only, profile=args.profile, roofline=args.roofline
    )
    print(format_table(results, spec))
    if "lorafuse" in runs:
        print(runs["lorafuse"][-1]["report"])
    for r in runs.get("lorafuse", []):
        if "profile" in r:
            print("torch.profiler, one lorafuse step (self CPU time):")
            print(r["profile"])
    if args.json:
        meta = {"spec": spec, "backends": backends.describe(), "runs": runs}
        write_json(args.json, {**results, **meta})
    return 0
