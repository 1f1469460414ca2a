"""Question: which ops' large CPU buffers are alive at a QLoRA training step's peak?
Answer: at the fused loss, the head's block beside the logits chunk (32 MiB blocks put 53 MiB
more there), tied with the MLP's backward (Llama-3.2-1B NF4, 2-core AMD EPYC, sessions 18-19).
Constant: ``ops.weights.ROW_BLOCK_BYTES`` (src/lorafuse/ops/weights.py).

One bench model (:func:`lorafuse.bench.llm.build_model`, the spec ``lorafuse bench`` gives its
workers) takes a warm-up step, then one step under ``torch.profiler`` with memory profiling. Its
allocation and free events of at least ``--min-mib`` are replayed in time order; at the moment
their live sum peaks, the live buffers are printed grouped by size and by the op stack that
allocated them (the last four frames). Smaller allocations are left out, so the sum is the large
buffers' peak, not the process's.

    python benchmarks/probes/peak_by_op.py [--config lorafuse-nf4+emb] [--model llama-3.2-1b]
        [--batch 1] [--seq 512] [--no-grad-ckpt] [--min-mib 1]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch._C._profiler import _EventType

from lorafuse.bench.llm import adamw, build_model, token_batches, train_step


def _allocations(prof) -> list[tuple[int, int, int, str]]:
    """``(time ns, address, bytes (negative: a free), op stack)`` of every allocator event."""
    events = []

    def walk(node, stack):
        if node.typed[0] == _EventType.Allocation:
            e = node.typed[1]
            events.append((node.start_time_ns, e.ptr, e.alloc_size, "/".join(stack[-4:])))
            return
        for child in node.children:
            walk(child, [*stack, node.name])

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    return sorted(events)


def peak_buffers(events, min_bytes: int) -> tuple[int, dict[int, tuple[int, str]]]:
    """The largest live sum of buffers of at least ``min_bytes``, and those buffers then."""
    live, current, peak, at_peak = {}, 0, 0, {}
    for _, ptr, size, where in events:
        if abs(size) < min_bytes:
            continue
        if size > 0:
            live[ptr] = (size, where)
            current += size
        elif ptr in live:
            current -= live.pop(ptr)[0]
        if current > peak:
            peak, at_peak = current, dict(live)
    return peak, at_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="lorafuse-nf4+emb",
                    help="a bench configuration: lorafuse, lorafuse-nf4, lorafuse-nf4+emb, stock")  # fmt: skip
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    ap.add_argument("--min-mib", type=float, default=1.0)
    args = ap.parse_args()
    spec = dict(config=args.config, model=args.model, dtype=args.dtype, device="cpu",
                batch=args.batch, seq=args.seq, rank=args.rank, grad_ckpt=args.grad_ckpt,
                backend="auto", warmup=1, steps=1, roofline=False)  # fmt: skip
    model = build_model(spec)
    batches = token_batches(spec, 2)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    train_step(model, opt, batches[0])  # warm-up: kept buffers and caches as in a steady step
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        train_step(model, opt, batches[1])
    peak, at_peak = peak_buffers(_allocations(prof), int(args.min_mib * 2**20))
    print(f"{args.config} {args.model} {args.batch} x {args.seq}, grad-ckpt "
          f"{'on' if args.grad_ckpt else 'off'}: peak of buffers >= {args.min_mib:g} MiB "
          f"{peak / 2**20:.1f} MiB")  # fmt: skip
    groups = collections.Counter((size >> 10, where) for size, where in at_peak.values())
    for (kib, where), n in sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1]):
        print(f"{n:4d} x {kib:7d} KiB  {where}")


if __name__ == "__main__":
    main()
