"""Question: should the C++ kernels deal work from a shared counter or give equal shares?
Answer: deal: about even on equal cores (step 1.01-1.02x), with a busy core attention
1.04-1.68x, a SmolLM2 step 1.02-1.15x (static / dealt, 2-core AMX Xeon).
Constant: ``parallel_tasks`` / ``parallel_rows`` (src/lorafuse/csrc/common.h, dealt by default).

The C++ kernels' parallel schedule: work dealt from a shared counter vs equal shares per thread.

at::parallel_for gives each thread one equal share, so every thread waits for the slowest; when
one core runs slower (a cloud vCPU whose hyperthread sibling another tenant keeps busy, an
efficiency core, another process) that wait is the whole difference. The kernels now deal tasks
from a counter (``csrc/common.h``: ``parallel_tasks`` / ``parallel_rows``); this times each
kernel's call at SmolLM2-135M's training shapes (4 x 512 tokens, bf16) with the old equal shares
(``set_dynamic_schedule(False)``) and the dealt tasks, interleaved in one process.
ratio = static / dealt (> 1: dealing is faster). ``--competitor`` runs a busy loop pinned to
CPU 0 meanwhile (a core shared with another process); ``--step`` adds a whole training step of
the bench's SmolLM2 model. Before and after, one bf16 GEMM is timed pinned to each CPU (in a
child process), to show how unequal the cores were.

    python benchmarks/probes/schedule.py [--repeats 15] [--competitor] [--step | --only-step]
    OMP_WAIT_POLICY=PASSIVE python benchmarks/probes/schedule.py --only-step --competitor

The step's times under each schedule also compare thread settings run one command each
(``OMP_WAIT_POLICY``, ``--threads``), as docs/training.md's tip on busy CPUs does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from lorafuse import _ext, backends
from lorafuse.ops import attention, cross_entropy, rms_norm, rope, swiglu
from lorafuse.ops.nf4 import quantize_nf4
from lorafuse.testing.timing import interleaved_medians

BF16 = torch.bfloat16
N, D, INTER, VOCAB = 2048, 576, 1536, 49152  # SmolLM2-135M, 4 x 512 tokens
CORE_PROBE = """
import torch
from lorafuse.testing.timing import median_time
torch.set_num_threads(1)
a, b = torch.randn(2048, 576).bfloat16(), torch.randn(576, 1536).bfloat16()
print(median_time(lambda: a @ b, 15, warmup=3) * 1e3)
"""


def core_speeds() -> str:
    """ms of one (2048, 576) x (576, 1536) bf16 GEMM pinned to each CPU this process may use."""
    out = []
    for cpu in sorted(os.sched_getaffinity(0)):
        cmd = ["taskset", "-c", str(cpu), sys.executable, "-c", CORE_PROBE]
        ms = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
        out.append(f"cpu{cpu} {float(ms):.2f} ms")
    return ", ".join(out)


def _leaf(*shape):
    return torch.randn(*shape).to(BF16).requires_grad_()


def kernel_cases() -> dict:
    """name -> closure: one forward + backward (or one call) of each dealt kernel."""
    q, k, v = _leaf(4, 9, 512, 64), _leaf(4, 3, 512, 64), _leaf(4, 3, 512, 64)
    gate, up, x = _leaf(N, INTER), _leaf(N, INTER), _leaf(N, D)
    w = torch.ones(D, dtype=BF16)
    rq, rk = _leaf(4, 9, 512, 64), _leaf(4, 3, 512, 64)
    cos, sin = torch.randn(4, 512, 64).to(BF16), torch.randn(4, 512, 64).to(BF16)
    hidden, head = _leaf(N, D), (torch.randn(VOCAB, D) / D**0.5).to(BF16)
    targets = torch.randint(0, VOCAB, (N,))
    y, xa, B = torch.randn(N, INTER).to(BF16), torch.randn(N, 16), torch.randn(INTER, 16)
    nf4 = quantize_nf4(torch.randn(8192, 2048))  # a Llama-3.2-1B MLP weight
    dense = torch.empty(8192, 2048, dtype=BF16)
    ext = _ext.load_cpp()

    def backward(*outs):
        torch.autograd.backward([o.float().sum() for o in outs])

    return {
        "attention fwd+bwd": lambda: backward(attention.causal_attention(q, k, v, 0.125, "cpp")),
        "swiglu fwd+bwd": lambda: backward(swiglu.swiglu(gate, up, backend="cpp")),
        "rms_norm fwd+bwd": lambda: backward(rms_norm.rms_norm(x, w, 1e-5, backend="cpp")),
        "rope fwd+bwd": lambda: backward(*rope.apply_rope(rq, rk, cos, sin, backend="cpp")),
        "loss fwd+bwd": lambda: backward(
            cross_entropy.fused_linear_cross_entropy(hidden, head, targets, backend="cpp")
        ),
        "rank up_add_": lambda: ext.lora_rank_up_add_(y, xa, B, 2.0),
        "nf4 dequantize": lambda: ext.nf4_dequantize_forward(
            nf4["codes"], nf4["absmax_q"], nf4["absmax_scale"], nf4["absmax_offset"], dense
        ),
    }


def step_case() -> dict:
    from lorafuse.bench import llm

    spec = dict(model="smollm2-135m", dtype="bf16", device="cpu", batch=4, seq=512, rank=16,
                grad_ckpt=False, backend=None, config="lorafuse")  # fmt: skip
    model = llm.build_model(spec)
    (ids,) = llm.token_batches(spec, 1)
    opt = llm.adamw([p for p in model.parameters() if p.requires_grad])
    return {"training step": lambda: llm.train_step(model, opt, ids)}


def scheduled(fn, dynamic: bool):
    ext = _ext.load_cpp()

    def run():
        ext.set_dynamic_schedule(dynamic)
        try:
            fn()
        finally:
            ext.set_dynamic_schedule(True)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--competitor", action="store_true", help="a busy loop pinned to CPU 0")
    p.add_argument("--step", action="store_true", help="also a SmolLM2 training step")
    p.add_argument("--only-step", action="store_true", help="only the training step")
    args = p.parse_args(argv)
    if not backends.cpp_available():
        print("C++ extension unavailable: nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', '(default)')}, load {os.getloadavg()[0]:.2f}; one bf16 GEMM per core: "
          f"{core_speeds()}")  # fmt: skip
    cases = {} if args.only_step else kernel_cases()
    if args.step or args.only_step:
        cases.update(step_case())
    busy = None
    if args.competitor:
        loop = "while True: pass"
        busy = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", loop])
        print("competitor: a busy loop pinned to CPU 0")
    try:
        print(f"{'case':<22}{'static ms':>11}{'dealt ms':>10}{'ratio':>8}")
        for name, fn in cases.items():
            fns = {"static": scheduled(fn, False), "dealt": scheduled(fn, True)}
            t = interleaved_medians(fns, args.repeats, args.warmup)
            t_static, t_dealt = t["static"], t["dealt"]
            print(f"{name:<22}{1e3 * t_static:>11.2f}{1e3 * t_dealt:>10.2f}"
                  f"{t_static / t_dealt:>8.2f}", flush=True)  # fmt: skip
    finally:
        if busy:
            busy.kill()
    print(f"load {os.getloadavg()[0]:.2f}; one bf16 GEMM per core: {core_speeds()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
