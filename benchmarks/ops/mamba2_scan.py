"""Mamba2's chunked scan on CPU: lorafuse's op (``ops/mamba2_scan.py``, the torch reference with
its autograd) against transformers' ``mamba2_chunk_scan`` (Granite 4's CPU path), forward and
forward + backward, on one row of T tokens at Granite-4-hybrid-like widths (``--heads`` x
``--head-dim`` channels, ``--state`` state size, one group, chunk 256; pass the model's widths).
transformers has no per-example boundaries: ``packed`` times lorafuse's op on the same row cut
into ``--examples`` packed examples (what a packed training row costs). Interleaved rounds, the
median of ``--repeats``; ratio = transformers / lorafuse (> 1: lorafuse is faster).

    python benchmarks/ops/mamba2_scan.py [--tokens 2048] [--heads 48] [--head-dim 64]
        [--state 128] [--examples 8] [--threads 2] [--repeats 7] [--json f]
"""

from __future__ import annotations

import argparse
import math

import torch

from lorafuse.files import write_json
from lorafuse.ops.mamba2_scan import mamba2_scan
from lorafuse.testing.timing import interleaved_medians

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(args, dtype):
    g = torch.Generator().manual_seed(0)
    t, h, p, n = args.tokens, args.heads, args.head_dim, args.state

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()

    return dict(x=r(1, t, h, p), dt=r(1, t, h), A=-torch.rand(h, generator=g).add(0.5).to(dtype),
                B=r(1, t, 1, n, scale=0.3), C=r(1, t, 1, n, scale=0.3), D=r(h), dt_bias=r(h))  # fmt: skip


def _calls(args, dtype, backward: bool) -> dict:
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    i = _inputs(args, dtype)
    cut = torch.linspace(0, args.tokens, args.examples + 1).round().long()  # (N+1,)
    kw = dict(D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True, chunk_size=256)

    def run(y):
        if backward:
            y.float().sum().backward()

    def stock():
        run(mamba2_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], **kw))

    def ours():
        run(mamba2_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], **kw)[0])

    def packed():
        run(mamba2_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], cu_seqlens=cut, **kw)[0])

    return {"transformers": stock, "lorafuse": ours, "lorafuse packed": packed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'dtype':5} {'pass':9} {'transformers ms':>15} {'lorafuse ms':>11} {'ratio':>6} "
          f"{'packed ms':>9}")  # fmt: skip
    for name, dtype in DTYPES.items():
        for backward in (False, True):
            with torch.set_grad_enabled(backward):
                med = interleaved_medians(_calls(args, dtype, backward), args.repeats, rotate=True)
            ms = {k: v * 1e3 for k, v in med.items()}
            ratio = ms["transformers"] / ms["lorafuse"]
            kind = "fwd+bwd" if backward else "fwd"
            print(f"{name:5} {kind:9} {ms['transformers']:15.1f} {ms['lorafuse']:11.1f} "
                  f"{ratio:6.2f} {ms['lorafuse packed']:9.1f}")  # fmt: skip
            rows.append(dict(dtype=name, passes=kind, ratio=ratio, **ms))
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})
    assert all(math.isfinite(r["ratio"]) for r in rows)


if __name__ == "__main__":
    main()
