"""Checks the collectives of :mod:`lorafuse.train.distributed` on a real process group.

Run under ``torchrun --nproc-per-node W``; every rank asserts, and a failure exits non-zero.
Imports only torch + lorafuse (fast: no transformers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lorafuse.train import distributed as D


def main() -> int:
    torch.set_num_threads(1)
    ctx = D.setup("auto")
    w, r = ctx.world_size, ctx.rank
    assert dist.is_initialized() and w > 1 and ctx.strategy == "ddp" and ctx.device.type == "cpu"
    assert D.is_main(ctx) == (r == 0) == ctx.is_main
    assert D.loss_scale(ctx) == float(w)
    # int stays int and exact; float sums in float64; a Tensor comes back new, input untouched
    got = D.all_reduce_sum(r + 1, ctx)
    assert type(got) is int and got == w * (w + 1) // 2, got
    big = D.all_reduce_sum(2**40 + r, ctx)  # beyond fp32/fp64-safe? int64 keeps it exact
    assert big == w * 2**40 + w * (w - 1) // 2, big
    f = D.all_reduce_sum(0.1 * (r + 1), ctx)
    assert type(f) is float and abs(f - 0.1 * w * (w + 1) / 2) < 1e-12, f
    x = torch.full((3,), float(r + 1))
    y = D.all_reduce_sum(x, ctx)
    assert torch.equal(x, torch.full((3,), float(r + 1))), "input modified"
    assert torch.equal(y, torch.full((3,), w * (w + 1) / 2)), y
    # the shares of every rank, gathered: disjoint and covering, for even and uneven batches
    for n in (0, 1, w - 1, w, 2 * w + 1, 17):
        shares: list = [None] * w
        dist.all_gather_object(shares, D.shard_rows(n, ctx))
        flat = sorted(i for s in shares for i in s)
        assert flat == list(range(n)), (n, shares)
        assert max(len(s) for s in shares) == D.rows_per_rank(n, ctx), (n, shares)
    per_rank, total = D.throughput(100 * (r + 1), 1.0 + r, ctx)
    assert abs(per_rank - 100 * (r + 1) / (1.0 + r)) < 1e-9
    assert abs(total - 100 * w * (w + 1) / 2 / w) < 1e-9, total  # slowest rank took w seconds
    D.barrier(ctx)
    D.cleanup(ctx)
    assert not dist.is_initialized()
    print(f"rank {r}: collectives ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
