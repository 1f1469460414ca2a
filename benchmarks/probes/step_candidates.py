"""Question: where could a bf16 training step still get faster?
Answer: nowhere worth its cost: cold or transposed operands 0.92-1.08x, the LoRA term folded
into K ~4% (bf16 adapters), up-add <= 1.5%, prepacking 1.00-1.08x (2-core AMX Xeon).
Constant: none set; every candidate was left (docs/benchmarks-log.md).

* ``instep``: do torch's products run slower inside a lorafuse step than alone? One profiled
  step's ``aten::mm`` calls against the same shapes timed alone right after (ratio > 1: slower
  in the step); ``--rounds`` times.
* ``cold``: a product after a 64 MiB write (its operands out of cache) against the same product
  repeated (median of cold / warm pairs); ``layout``: the weight as stored against a contiguous
  transpose, forward and input gradient (paired ratios).
* ``fold``: gate's product plus ``lora_rank_up_add_`` against one product with the LoRA term in
  K (``[x | xa]·[W | B]ᵀ``, K padded by 32), and against the product alone (paired ratios).
* ``upadd``: ``lora_rank_up_add_`` against an in-place pass (``mul_``) and an add (``add_``) over
  the same bf16 output (paired ratios: < 1, the up-add is slower).
* ``swiglu``: one layer's SwiGLU forward, backward, a copy of h and down's gB recomputed
  (medians, ms): what folding the forward's recompute into the backward could save.
* ``prepack``: ``F.linear`` against a weight prepacked once for oneDNN
  (``mkldnn._reorder_linear_weight`` + ``_linear_pointwise``), paired ratios, outputs compared.
* ``lora``: the roofline's rank-r products' seconds against the whole roofline, per model.
* ``imports``: the RSS a fresh interpreter reaches after each import the bench's worker makes.

    python benchmarks/probes/step_candidates.py [--only instep fold ...] [--repeats 15]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

from lorafuse import backends, hardware, heap
from lorafuse.ops.lora_split import rank_ops
from lorafuse.testing.timing import median_time, paired_ratio

N, R = 2048, 16
PROJECTIONS = {"gate/up 576->1536": (576, 1536), "down 1536->576": (1536, 576),
               "q/o 576->576": (576, 576), "llama-4l gate 1024->2816": (1024, 2816)}  # fmt: skip


def median_ms(fn, repeats: int) -> float:
    return median_time(fn, repeats) * 1e3


def bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape).bfloat16()


def product_ms(m: int, k: int, n: int) -> float:
    """Median ms of one (m, k) @ (k, n) bf16 product, the weight a transposed view as in a step."""
    a, b = bf16(m, k), bf16(n, k).t()
    return median_ms(lambda: a @ b, 5)


def instep(args) -> None:
    from torch.profiler import profile

    from lorafuse.bench import llm

    spec = dict(model="smollm2-135m", dtype="bf16", device="cpu", batch=4, seq=512, rank=R,
                config="lorafuse", grad_ckpt=False, backend=None)  # fmt: skip
    model, (ids,) = llm.build_model(spec), llm.token_batches(spec, 1)
    opt = llm.adamw([p for p in model.parameters() if p.requires_grad])
    for _ in range(2):
        llm.train_step(model, opt, ids)
    for rnd in range(args.rounds):
        with profile(record_shapes=True) as prof:
            llm.train_step(model, opt, ids)
        calls = collections.defaultdict(list)  # ((m, k), (k, n)) -> ms per call in the step
        for e in prof.events():
            if e.name == "aten::mm":
                calls[tuple(map(tuple, e.input_shapes[:2]))].append(e.cpu_time_total / 1e3)
        in_step = sum(sum(ms) for ms in calls.values())
        alone = sum(len(ms) * product_ms(m, k, n) for ((m, k), (_, n)), ms in calls.items())
        print(f"instep round {rnd}: aten::mm in the step {in_step:.0f} ms, the same shapes alone "
              f"{alone:.0f} ms: in-step / alone {in_step / alone:.2f}")  # fmt: skip


def cold_ratio(d: int, k: int, repeats: int) -> float:
    """Median of (product after a 64 MiB write) / (the product repeated), x (N, d) · Wᵀ (d, k)."""
    flush = torch.empty(16 * 2**20)
    x, w, out = bf16(N, d), bf16(k, d), torch.empty(N, k, dtype=torch.bfloat16)
    ratios = []
    for _ in range(repeats):
        torch.mm(x, w.t(), out=out)
        warm = median_ms(lambda: torch.mm(x, w.t(), out=out), 1)
        flush.fill_(1.0)
        cold_ms = median_time(lambda: torch.mm(x, w.t(), out=out), 1, warmup=0) * 1e3
        ratios.append(cold_ms / warm)
    return statistics.median(ratios)


def cold(args) -> None:
    for name, (d, k) in PROJECTIONS.items():
        print(f"cold {name}: cold / warm {cold_ratio(d, k, args.repeats):.2f}")


def layout_ratios(d: int, k: int, repeats: int) -> tuple[float, float]:
    """Weight as stored / its contiguous transpose: forward x·Wᵀ and input gradient g·W."""
    x, g, w = bf16(N, d), bf16(N, k), bf16(k, d)
    wt = w.t().contiguous()
    fwd = paired_ratio(lambda: x @ w.t(), lambda: x @ wt, repeats)
    return fwd, paired_ratio(lambda: g @ w, lambda: g @ wt.t(), repeats)


def layout(args) -> None:
    for name, (d, k) in PROJECTIONS.items():
        fwd, dx = layout_ratios(d, k, args.repeats)
        print(f"layout {name}: as stored / contiguous transpose: forward {fwd:.2f}, "
              f"input gradient {dx:.2f}")  # fmt: skip


def fold(args) -> None:
    (up_add_,) = backends.compiled("lora_rank", "cpp", "up_add_")
    d, k = PROJECTIONS["gate/up 576->1536"]
    x, w, xa, b = bf16(N, d), bf16(k, d), torch.randn(N, R), torch.randn(k, R)
    x_aug = torch.zeros(N, d + 32, dtype=torch.bfloat16)
    x_aug[:, :d], x_aug[:, d : d + R] = x, xa
    w_aug = torch.zeros(k, d + 32, dtype=torch.bfloat16)
    w_aug[:, :d], w_aug[:, d : d + R] = w, b
    y = torch.empty(N, k, dtype=torch.bfloat16)

    def separate():
        torch.mm(x, w.t(), out=y)
        up_add_(y, xa, b, 2.0)

    folded = paired_ratio(separate, lambda: torch.mm(x_aug, w_aug.t(), out=y), args.repeats)
    plain = paired_ratio(lambda: torch.mm(x, w.t(), out=y),
                         lambda: torch.mm(x_aug, w_aug.t(), out=y), args.repeats)  # fmt: skip
    print(
        f"fold gate: (product + up-add) / folded {folded:.2f}; product alone / folded {plain:.2f}"
    )


def upadd_ratios(k: int, repeats: int) -> tuple[float, float]:
    """An in-place pass (mul_) and an add (add_) over y (N, k) bf16, each / lora_rank_up_add_."""
    (up_add_,) = backends.compiled("lora_rank", "cpp", "up_add_")
    y, z, xa, b = bf16(N, k), bf16(N, k), torch.randn(N, R), torch.randn(k, R)
    mul = paired_ratio(lambda: y.mul_(1.0), lambda: up_add_(y, xa, b, 1e-3), repeats)
    return mul, paired_ratio(lambda: y.add_(z), lambda: up_add_(y, xa, b, 1e-3), repeats)


def upadd(args) -> None:
    for k in (1536, 2816):
        mul, add = upadd_ratios(k, args.repeats)
        print(f"upadd {N} x {k}: mul_ / up-add {mul:.2f}, add_ / up-add {add:.2f}")


def swiglu(args) -> None:
    fwd, bwd = backends.compiled("swiglu", "cpp", "forward", "backward")
    rank = rank_ops("cpp", torch.float32, torch.bfloat16)
    inter, d = PROJECTIONS["gate/up 576->1536"][1], PROJECTIONS["down 1536->576"][1]
    gate, up, dh = bf16(N, inter), bf16(N, inter), bf16(N, inter)
    h, g, b, xa = torch.empty_like(gate), bf16(N, d), torch.randn(d, R), torch.randn(N, R)
    ms = {
        "forward": median_ms(lambda: fwd(gate, up), args.repeats),
        "backward": median_ms(lambda: bwd(dh, gate, up), args.repeats),
        "copy of h": median_ms(lambda: h.copy_(gate), args.repeats),
        "down's gB": median_ms(lambda: rank.grads(g, b, xa, 2.0, True, False), args.repeats),
    }
    saved = ms["forward"] - ms["copy of h"] - ms["down's gB"]
    print("swiglu per SmolLM2 layer (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items())
          + f"; folding the recompute saves at most ~{saved:.3f}")  # fmt: skip


def prepack_ratio(d: int, k: int, repeats: int) -> tuple[float, bool]:
    """F.linear / the same weight prepacked for oneDNN, and whether their outputs are identical."""
    x, w = bf16(N, d), bf16(k, d)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, N)

    def prepacked():
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    same = torch.equal(F.linear(x, w), prepacked())
    return paired_ratio(lambda: F.linear(x, w), prepacked, repeats), same


def prepack(args) -> None:
    for name, (d, k) in PROJECTIONS.items():
        ratio, same = prepack_ratio(d, k, args.repeats)
        print(f"prepack {name}: F.linear / prepacked {ratio:.2f} (bit-identical: {same})")


def lora(args) -> None:
    from lorafuse.bench import llm

    for model in ("smollm2-135m", "llama-4l-1024"):
        roof = llm.run_roofline(dict(model=model, dtype="bf16", device="cpu", batch=4, seq=512,
                                     rank=R))  # fmt: skip
        rank_s = sum(p["seconds"] for p in roof["products"] if ".lora_" in p["name"])
        print(f"lora {model}: rank-r products {rank_s:.3f} s of a {roof['seconds']:.3f} s "
              f"roofline ({rank_s / roof['seconds']:.0%})")  # fmt: skip


IMPORTS = """
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
out = [('python', rss())]
import torch; out.append(('torch', rss()))
import peft; out.append(('peft (transformers with it)', rss()))
from transformers import LlamaForCausalLM; out.append(('transformers Llama', rss()))
from lorafuse import patching; out.append(('lorafuse.patching', rss()))
print(', '.join(f'{name} {mib} MiB' for name, mib in out))
"""


def imports(args) -> None:
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True)
    print(f"imports (RSS after each, a fresh interpreter): {out.stdout.strip() or out.stderr}")


SECTIONS = {"instep": instep, "cold": cold, "layout": layout, "fold": fold, "upadd": upadd,
            "swiglu": swiglu, "prepack": prepack, "lora": lora, "imports": imports}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3, help="instep: profiled steps")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    heap.reuse_freed_buffers_up_to(heap.TRAINING_BYTES)  # as patch_peft_model sets it on CPU
    torch.manual_seed(0)
    print(f"step_candidates: CPU {hardware.cpu_capability()}, {torch.get_num_threads()} "
          f"threads, bf16, N = {N}")  # fmt: skip
    for name in args.only:
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
