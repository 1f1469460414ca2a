"""Question: how much of a bench run's peak RSS is memory glibc holds free?
Answer: 153-227 MiB (bf16), 175-328 MiB (NF4 + embeddings) in a Llama-3.2-1B 1 x 512 step, so
QLoRA's target took an allocator of our own and NF4 tiles both (2-core AMX Xeon).
Constant: ``heap.LARGE_BUFFER_BYTES`` (src/lorafuse/heap.py), ``ops.weights.TILE_BYTES``.

Each configuration runs in the bench's own worker (:func:`lorafuse.bench.llm.run_worker`, same
spec as ``lorafuse bench --model llama-3.2-1b --batch 1 --seq 512 --grad-ckpt --quant nf4``)
with a malloc interposer preloaded (``LD_PRELOAD``, compiled here with gcc): it counts the bytes
malloc has handed out and not taken back, and their peak from the moment the bench's memory
probe starts. Printed per configuration, MiB:

* ``RSS peak``: the bench's peak total (VmHWM);
* ``in use at start`` / ``in-use peak``: malloc's bytes in use when the probe starts and their
  peak during the steps;
* ``not malloc's``: RSS at the start minus malloc's bytes in use then (libraries, Python's own
  arenas, thread stacks);
* ``held free``: RSS peak - in-use peak - not malloc's, the freed memory the heap kept resident.

    python benchmarks/probes/heap_peak.py [--configs lorafuse lorafuse-nf4+emb] [--repeats 2]

glibc only (the interposer calls glibc's ``__libc_*`` entry points).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SHIM = r"""
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>
extern void *__libc_malloc(size_t), *__libc_calloc(size_t, size_t), *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
static _Atomic long cur, peak;
static void add(long n) {
  long c = atomic_fetch_add(&cur, n) + n, p = atomic_load(&peak);
  while (c > p && !atomic_compare_exchange_weak(&peak, &p, c)) {}
}
static void *took(void *p) { if (p) add((long)malloc_usable_size(p)); return p; }
void *malloc(size_t n) { return took(__libc_malloc(n)); }
void *calloc(size_t a, size_t b) { return took(__libc_calloc(a, b)); }
void *memalign(size_t a, size_t n) { return took(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return took(__libc_memalign(a, n)); }
void free(void *p) { if (p) { add(-(long)malloc_usable_size(p)); __libc_free(p); } }
void *realloc(void *q, size_t n) {
  long old = q ? (long)malloc_usable_size(q) : 0;
  void *p = __libc_realloc(q, n);
  if (p || n == 0) add(-old);
  return took(p);
}
int posix_memalign(void **r, size_t a, size_t n) {
  void *p = took(__libc_memalign(a, n));
  if (!p) return 12; /* ENOMEM */
  *r = p;
  return 0;
}
long shim_current(void) { return cur; }
long shim_peak(void) { return peak; }
void shim_reset(void) { atomic_store(&peak, atomic_load(&cur)); }
"""

WORKER = r"""
import ctypes, json, sys
shim = ctypes.CDLL(sys.argv[1])
shim.shim_current.restype = shim.shim_peak.restype = ctypes.c_long
from lorafuse.bench import llm, process

at_start = {}
start = process.MemoryProbe.start  # the class llm.run_worker uses
def start_and_reset(probe):
    start(probe)
    at_start["malloc"] = shim.shim_current()
    shim.shim_reset()
process.MemoryProbe.start = start_and_reset
out = llm.run_worker(json.loads(sys.argv[2]))
print(json.dumps({"rss_peak": out["peak_total_bytes"], "rss_start": out["start_bytes"],
                  "malloc_start": at_start["malloc"], "malloc_peak": shim.shim_peak()}))
"""


def build_shim(directory: str) -> str:
    src, lib = os.path.join(directory, "shim.c"), os.path.join(directory, "libshim.so")
    with open(src, "w") as f:
        f.write(SHIM)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    return lib


def run(lib: str, config: str, args) -> dict:
    spec = dict(model=args.model, dtype="bf16", device="cpu", batch=1, seq=args.seq, rank=16,
                grad_ckpt=True, config=config, backend="auto", warmup=1, steps=args.steps,
                roofline=False, threads=args.threads)  # fmt: skip
    env = {**os.environ, "LD_PRELOAD": lib}
    proc = subprocess.run([sys.executable, "-c", WORKER, lib, json.dumps(spec)], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["lorafuse", "lorafuse-nf4+emb"])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_shim(tmp)
        print("config  RSS peak  in use at start  in-use peak  not malloc's  held free (MiB)")
        for _ in range(args.repeats):
            for config in args.configs:
                r = run(lib, config, args)
                other = r["rss_start"] - r["malloc_start"]
                held = r["rss_peak"] - r["malloc_peak"] - other
                print(f"{config}  {r['rss_peak'] // mib}  {r['malloc_start'] // mib}  "
                      f"{r['malloc_peak'] // mib}  {other // mib}  {held // mib}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
