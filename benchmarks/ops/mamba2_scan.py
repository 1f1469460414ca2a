"""Mamba2's chunked scan on CPU: transformers' torch scan against lorafuse's op on its torch and
C++ backends, forward and forward + backward, and one decoding token.

* ``transformers``: ``mamba2_chunk_scan`` (Granite 4's CPU path, plain autograd);
* ``torch``: lorafuse's op with ``backend="torch"`` (``ops/mamba2_scan_chunks.py``: the chunked
  form with the hand-written backward);
* ``cpp``: ``backend="cpp"`` (``csrc/mamba2_scan.cpp``); ``cpp packed``: the same row cut into
  ``--examples`` packed examples (transformers has no per-example boundaries);
* ``--subs``: the C++ kernel's sub-chunk (tokens per BLAS product; ``kSub`` in the source),
  forward + backward through the extension directly, fp32;
* decoding (``--batch`` rows, one token from a state): transformers'
  ``mamba2_selective_state_update`` vs the op (torch: the recurrence; cpp: ``mamba2_scan_step``).

One row of ``--tokens`` tokens at Granite-4-like widths: ``--heads`` x ``--head-dim`` channels,
``--state``, ``--groups``, chunk 256 (defaults: 48 heads of 64, state 128, one group, the widths of
Granite-4.0-H-Tiny's published config). Interleaved rounds (rotated), the median of ``--repeats``;
``ratio`` = transformers / that column (> 1: faster than transformers).

    python benchmarks/ops/mamba2_scan.py [--tokens 2048] [--heads 48] [--head-dim 64]
        [--state 128] [--groups 1] [--examples 8] [--threads 2] [--repeats 5] [--json f]
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from lorafuse import backends
from lorafuse.files import write_json
from lorafuse.ops.mamba2_scan import mamba2_scan
from lorafuse.testing.timing import interleaved_medians

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(args, dtype, t=None, grad=True):
    g = torch.Generator().manual_seed(0)
    t, h, p, n, grp = t or args.tokens, args.heads, args.head_dim, args.state, args.groups

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).requires_grad_(grad)

    # dt' around softplus(-2) ~ 0.13 and A in [-16, -1] (Granite's A_log init): the decays a
    # trained layer shows, well inside what a 256-token chunk holds.
    return dict(x=r(1, t, h, p), dt=r(1, t, h, scale=0.5, shift=-2.0),
                A=-torch.linspace(1, 16, h), B=r(1, t, grp, n, scale=0.3),
                C=r(1, t, grp, n, scale=0.3), D=r(h), dt_bias=r(h, scale=0.1))  # fmt: skip


def _calls(args, dtype, backward: bool) -> dict:
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    i = _inputs(args, dtype, grad=backward)
    cut = torch.linspace(0, args.tokens, args.examples + 1).round().long()  # (N+1,)
    kw = dict(D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True, chunk_size=256)
    xs = (i["x"], i["dt"], i["A"], i["B"], i["C"])

    def run(y):
        if backward:
            y.float().sum().backward()

    calls = {"transformers": lambda: run(mamba2_chunk_scan(*xs, **kw))}
    calls["torch"] = lambda: run(mamba2_scan(*xs, **kw, backend="torch")[0])
    if backends.cpp_available():
        calls["cpp"] = lambda: run(mamba2_scan(*xs, **kw, backend="cpp")[0])
        calls["cpp packed"] = lambda: run(mamba2_scan(*xs, cu_seqlens=cut, **kw,
                                                      backend="cpp")[0])  # fmt: skip
    return calls


def _sub_calls(args) -> dict:
    fwd, bwd = backends.compiled("mamba2_scan", "cpp", "forward", "backward")
    i = _inputs(args, torch.float32, grad=False)
    a = (*i.values(), None, None, True, 0.0, float("inf"), 256)
    gy = torch.randn(1, args.tokens, args.heads, args.head_dim)

    def one(sub):
        y, _, saved = fwd(*a, sub=sub)
        bwd(gy, None, *a[:9], saved, *a[9:], (True,) * 8, sub=sub)

    return {f"sub {s}": (lambda s=s: one(s)) for s in args.subs}


def _step_calls(args, dtype) -> dict:
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        mamba2_selective_state_update,
    )

    b, h, p, n = args.batch, args.heads, args.head_dim, args.state
    i = {k: v.expand(b, *v.shape[1:]) if v.dim() > 1 else v
         for k, v in _inputs(args, dtype, t=1, grad=False).items()}  # fmt: skip
    state = torch.randn(b, h, p, n)
    per_p = lambda v: v[..., None].expand(*v.shape, p)  # noqa: E731 - (.., H) -> (.., H, P)
    kw = dict(D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True, initial_state=state,
              output_final_state=True)  # fmt: skip
    xs = (i["x"], i["dt"], i["A"], i["B"], i["C"])
    stock_args = (i["x"][:, 0], per_p(i["dt"][:, 0]), per_p(i["A"])[..., None].expand(-1, -1, n),
                  i["B"][:, 0], i["C"][:, 0], per_p(i["D"]))  # fmt: skip
    calls = {
        "transformers": lambda: mamba2_selective_state_update(
            state.clone(), *stock_args, dt_bias=per_p(i["dt_bias"]), dt_softplus=True
        ),
        "torch": lambda: mamba2_scan(*xs, **kw, backend="torch"),
    }
    if backends.cpp_available():
        calls["cpp"] = lambda: mamba2_scan(*xs, **kw, backend="cpp")
    return calls


def _row(label, med, rows, **fields):
    ms = {k: v * 1e3 for k, v in med.items()}
    base = ms["transformers"] if "transformers" in ms else None
    cells = " ".join(f"{k} {v:8.2f} ms" + (f" ({base / v:5.2f}x)" if base else "")
                     for k, v in ms.items())  # fmt: skip
    print(f"{label:22} {cells}", flush=True)
    rows.append(dict(case=label, ms=ms, **fields))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="rows of the decoding step")
    ap.add_argument("--subs", type=int, nargs="*", default=[32, 64, 128])
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    print(f"CPU {cpu}, {args.threads} threads, load {os.getloadavg()[0]:.1f}, "
          f"C++ {backends.cpp_variant() if backends.cpp_available() else 'unavailable'}; "
          f"T={args.tokens} H={args.heads} P={args.head_dim} N={args.state} G={args.groups}")  # fmt: skip
    rows: list[dict] = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        for backward in (False, True):
            with torch.set_grad_enabled(backward):
                med = interleaved_medians(_calls(args, dtype, backward), args.repeats,
                                          rotate=True)  # fmt: skip
            _row(f"{name} {'fwd+bwd' if backward else 'fwd'}", med, rows, dtype=name)
        with torch.no_grad():
            med = interleaved_medians(_step_calls(args, dtype), args.repeats * 20, rotate=True)
        _row(f"{name} decode b={args.batch}", med, rows, dtype=name)
    if args.subs and backends.cpp_available():
        with torch.no_grad():
            med = interleaved_medians(_sub_calls(args), args.repeats, rotate=True)
        _row("fp32 cpp fwd+bwd subs", med, rows, dtype="fp32")
    if args.json:
        write_json(args.json, {"args": vars(args), "cpu": cpu, "rows": rows})


if __name__ == "__main__":
    main()
