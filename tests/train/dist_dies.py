"""A 2-rank job in which rank 1 fails, for the "a dead rank brings the job down" tests.

``--mode raise``: rank 1 raises at step 2; ``exit``: rank 1 vanishes (``os._exit(3)``, no
traceback); ``hang``: rank 1 stops communicating (sleeps) so rank 0's next collective must time
out (set ``LORAFUSE_DIST_TIMEOUT`` low).  Rank 0 keeps doing all-reduces.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from lorafuse.train import distributed as D


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["raise", "exit", "hang"], required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = D.setup("auto")
    for step in range(1000):
        if ctx.rank == 1 and step == 2:
            if args.mode == "raise":
                raise RuntimeError("rank 1 failed deliberately at step 2")
            if args.mode == "exit":
                os._exit(3)
            time.sleep(3600)
        D.all_reduce_sum(torch.ones(4), ctx)
        time.sleep(0.05)
    D.cleanup(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
