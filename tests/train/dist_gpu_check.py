"""CUDA / NCCL check of lorafuse.train.distributed (for a machine with >= 1 GPU; not a pytest test).

Run: ``torchrun --standalone --nproc-per-node 1 tests/train/dist_gpu_check.py``.  With one GPU
NCCL cannot run two ranks (one communicator may not hold the same GPU twice), so this joins a
1-rank NCCL process group itself and forces the DDP / FSDP2 code paths of ``wrap_model`` at
world 1: device_ids, the CUDA device mesh, fully_shard with frozen params, NF4 buffers and the
patched (Triton) model.  Each combination trains 4 steps and must match the unwrapped model.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_train_equivalence as E  # noqa: E402

from lorafuse.train import distributed as D  # noqa: E402


def run(strategy: str, four_bit: bool, patch: str, wrapped: bool) -> tuple[list, dict, str, str]:
    args = argparse.Namespace(seed=1234, patch=patch, load_in_4bit=four_bit, micro_batch=2,
                              dump_grads=False, _dumped=True, out="/tmp")  # fmt: skip
    ctx = D.DistContext(0, 1, 0, torch.device("cuda", 0), True, strategy if wrapped else "none")
    model, report = E.build_model(args, ctx)
    model = D.wrap_model(model, ctx)
    kind = type(model).__name__
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3, eps=1e-6)
    rows = E.make_rows(1234)
    losses = [E.train_step(model, opt, rows[5 * s : 5 * s + 5], ctx, args)[0] for s in range(4)]
    state = D.optimizer_state_dict(model, opt, ctx)
    D.load_optimizer_state_dict(model, opt, state, ctx)
    D.barrier(ctx)
    return losses, D.trainable_state_dict(model, ctx), kind, report.splitlines()[0]


def main() -> int:
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons
    torch.backends.cudnn.allow_tf32 = False
    ctx = D.setup("auto")
    print("setup() at world 1:", ctx, "process group:", dist.is_initialized())
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))  # fmt: skip
    failures = 0
    for four_bit in (False, True):
        for patch in ("no", "yes"):
            try:
                ref, ref_sd, _, rep = run("none", four_bit, patch, wrapped=False)
            except Exception:
                traceback.print_exc()
                print(f"REFERENCE FAILED 4bit={four_bit} patch={patch}")
                failures += 1
                continue
            for strategy in ("ddp", "fsdp"):
                try:
                    got, sd, kind, _ = run(strategy, four_bit, patch, wrapped=True)
                    dl = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
                    da = max(float((sd[k] - ref_sd[k]).abs().max()) for k in ref_sd)
                    ok = dl < 1e-5 and da < 1e-4
                    failures += not ok
                    print(f"{'OK  ' if ok else 'FAIL'} {strategy:4s} 4bit={four_bit!s:5s} "
                          f"patch={patch:3s} wrapper={kind} loss rel {dl:.1e} adapter abs {da:.1e}"
                          f" | {rep}")  # fmt: skip
                except Exception:
                    traceback.print_exc()
                    print(f"FAIL {strategy} 4bit={four_bit} patch={patch}: exception above")
                    failures += 1
    dist.destroy_process_group()
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
