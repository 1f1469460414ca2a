"""SwiGLU on CPU: the C++ kernel against an earlier version of itself and the torch reference.

Forward (``swiglu_forward``) and backward (``swiglu_backward``) are timed separately on
SmolLM2-135M's MLP at 2048 tokens (I = 1536) and at its hidden size (576), in bf16 and fp32, at
1 and 2 threads. The torch reference (``ops/swiglu.py`` ``_torch_forward`` / ``_torch_backward``)
is the fixed yardstick; ``--old REV`` also builds ``csrc/swiglu.cpp`` as of git revision REV (with
today's ``common.cpp`` / ``common.h``) as a private extension under the lorafuse cache, so the old
and the current kernel run in one process. All implementations run interleaved, in an order that
rotates every repeat (a, b, c, b, c, a, ...: the call right after the torch reference, whose
temporaries fill the cache, ran ~10% slower in the memory-bound fp32 cases); each figure is the
median of ``--repeats`` calls: wall time, and at 1 thread also this process's CPU time
(``time.process_time``), which drops time spent descheduled on a shared machine.
ratio = old / new (> 1: the current kernel is faster), torch / new without ``--old``.

    python benchmarks/ops/swiglu.py [--old HEAD~1] [--threads 1 2] [--repeats 31] [--json f]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from lorafuse import _ext
from lorafuse.files import write_json
from lorafuse.ops.swiglu import _torch_backward, _torch_forward
from lorafuse.testing.timing import interleaved_medians

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "src" / "lorafuse" / "csrc"
SHAPES = [(2048, 1536), (2048, 576)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# The old kernels declared here, not from today's common.h: swiglu_backward took three arguments
# before dgate_into_g (a rev with it is bound through a lambda with the flag off).
_SHIM = """#include <torch/extension.h>
namespace lorafuse {
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& g, const at::Tensor& gate,
                                                   const at::Tensor& up%(flag)s);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu_forward", &lorafuse::swiglu_forward);
  m.def("swiglu_backward", [](const at::Tensor& g, const at::Tensor& gate, const at::Tensor& up) {
    return lorafuse::swiglu_backward(g, gate, up%(off)s);
  });
}
"""


def build_old(rev: str):
    """swiglu.cpp as of ``rev``, compiled with today's common.cpp and the extension's flags."""
    from torch.utils.cpp_extension import load

    src = subprocess.run(
        ["git", "show", f"{rev}:src/lorafuse/csrc/swiglu.cpp"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    key_parts = [src, _SHIM, (CSRC / "common.cpp").read_text(), (CSRC / "common.h").read_text()]
    key = hashlib.sha256("\0".join(key_parts + _ext.compile_flags()).encode()).hexdigest()[:12]
    directory = _ext.cache_root() / "bench_swiglu" / key
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "swiglu_old.cpp").write_text(src)
    flagged = "bool dgate_into_g" in src
    shim = _SHIM % {"flag": ", bool" if flagged else "", "off": ", false" if flagged else ""}
    (directory / "shim.cpp").write_text(shim)
    return load(
        name=f"swiglu_old_{key}",
        sources=[str(directory / name) for name in ("swiglu_old.cpp", "shim.cpp")]
        + [str(CSRC / "common.cpp")],
        extra_cflags=_ext.compile_flags(),
        extra_include_paths=[str(CSRC)],
        build_directory=str(directory),
    )


def implementations(old_ext) -> dict:
    """name -> (forward(gate, up), backward(g, gate, up)); the torch reference first."""
    new = _ext.load_cpp()
    impls = {"torch": (_torch_forward, _torch_backward)}
    if old_ext is not None:
        impls["old"] = (old_ext.swiglu_forward, old_ext.swiglu_backward)
    impls["new"] = (new.swiglu_forward, new.swiglu_backward)
    return impls


def check_agree(impls: dict, gate, up, g) -> None:
    """Every implementation within a few roundings of the torch reference (the tests' bounds)."""
    tol = dict(atol=1e-5, rtol=1e-5) if gate.dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    ref_h, ref_b = _torch_forward(gate, up), _torch_backward(g, gate, up)
    for name, (fwd, bwd) in impls.items():
        torch.testing.assert_close(fwd(gate, up).float(), ref_h.float(), **tol, msg=name)
        for got, want in zip(bwd(g, gate, up), ref_b):
            torch.testing.assert_close(got.float(), want.float(), **tol, msg=name)


def bench_case(impls: dict, shape, dtype, threads: int, warmup: int, repeats: int) -> list[dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(shape, generator=gen) * 4).to(dtype)  # (N, I), both sigmoid tails
    up, g = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    check_agree(impls, gate, up, g)
    clocks = {"wall": time.perf_counter} | ({"cpu": time.process_time} if threads == 1 else {})
    rows = []
    for pass_, call in (
        ("fwd", lambda f, b: lambda: f(gate, up)),
        ("bwd", lambda f, b: lambda: b(g, gate, up)),
    ):
        fns = {name: call(f, b) for name, (f, b) in impls.items()}
        for clock_name, clock in clocks.items():
            medians = interleaved_medians(fns, repeats, warmup, clock, rotate=True)
            row = dict(shape=list(shape), dtype=str(dtype).removeprefix("torch."),
                       threads=threads, pass_=pass_, clock=clock_name)  # fmt: skip
            row |= {f"{name}_ms": 1e3 * t for name, t in medians.items()}
            rows.append(row)
    return rows


def print_row(row: dict, names: list[str]) -> None:
    shape = "x".join(map(str, row["shape"]))
    times = "".join(f"{row[f'{n}_ms']:>10.3f}" for n in names)
    ratio = row["old_ms"] / row["new_ms"] if "old_ms" in row else row["torch_ms"] / row["new_ms"]
    print(
        f"{shape:<11}{row['dtype']:<10}{row['threads']:>3} {row['pass_']:<5}{row['clock']:<6}"
        f"{times}{ratio:>8.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", metavar="REV", help="also time csrc/swiglu.cpp as of this git rev")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    impls = implementations(build_old(args.old) if args.old else None)
    names = list(impls)
    ratio = "old/new" if args.old else "torch/new"
    print(f"load average {os.getloadavg()}")
    print(f"{'shape':<11}{'dtype':<10}{'thr':>3} {'pass':<5}{'clock':<6}"
          + "".join(f"{n + ' ms':>10}" for n in names) + f"{ratio:>8}")  # fmt: skip
    rows = []
    for threads in args.threads:
        for shape in SHAPES:
            for dtype in DTYPES.values():
                for row in bench_case(impls, shape, dtype, threads, args.warmup, args.repeats):
                    print_row(row, names)
                    rows.append(row)
    if args.json:
        meta = dict(old=args.old, repeats=args.repeats, torch=torch.__version__,
                    load=os.getloadavg())  # fmt: skip
        write_json(args.json, dict(meta=meta, rows=rows))  # atomic
    return 0


if __name__ == "__main__":
    sys.exit(main())
