"""Question: how far does bf16 autocast move a short trainer run's loss from fp32, for stock too?
Answer: stock up to 1.31 x 2^-8 of the fp32 loss (5 of 72 steps past 2^-8), lorafuse 1.30 x
(2-core AMD EPYC with AVX-512-BF16): a bound of 2^-8 sat inside the noise.
Constant: ``AUTOCAST_FLOOR`` = 2^-7 (tests/train/test_trainers.py).

How far bf16 autocast moves a short trainer run's loss from fp32: stock PEFT against lorafuse.

``tests/train/test_trainers.py::test_autocast_bf16_runs_and_is_no_less_accurate`` trains its
memorised tiny Llama 3 steps under transformers' ``Trainer`` / TRL's ``SFTTrainer`` with
``bf16=True`` (CPU autocast), stock and patched, and bounds each step's distance from the fp32
run (``_autocast_bound``). The distance is bf16 rounding noise whose sign flips with any change in
operation order, so the bound must sit above that noise for stock itself. This repeats the test's
runs over several LoRA initialisations (``LORA_SEED``; the test uses 1) and prints, for both sides, the
RMS and the largest distances in units of 2^-8 of the fp32 loss, and how often each exceeds the
test's floor. Run it on both CPU branches:

    python benchmarks/probes/autocast_loss_noise.py [--seeds 8]
    LORAFUSE_CPU_LOW_PRECISION=emulated python benchmarks/probes/autocast_loss_noise.py
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "train")
)
import test_trainers as trainers  # noqa: E402  (the test's own model, data and runs)

from lorafuse.testing import single_thread  # noqa: E402

CASES = (("sft_packing", trainers.QV), ("trainer", trainers.QV), ("sft", trainers.ALL7))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=8, help="LoRA initialisations per case")
    args = p.parse_args(argv)
    threads = single_thread()  # as the test runs
    next(threads)
    setup = trainers.setup._fixture_function()
    sgd = dict(optim="sgd", lr=0.5)  # the test's optimizer
    rows = []  # (ours - fp32, stock - fp32, fp32) per step
    for trainers.LORA_SEED in range(1, args.seeds + 1):  # the test's runs, other LoRA inits
        for kind, targets in CASES:
            fp32 = trainers._train(setup, kind, targets, patched=False, bf16=False, **sgd)[0]
            stock = trainers._train(setup, kind, targets, patched=False, bf16=True, **sgd)[0]
            ours = trainers._train(setup, kind, targets, patched=True, bf16=True, **sgd)[0]
            rows += [(a - r, s - r, r) for a, s, r in zip(ours, stock, fp32)]
    branch = os.environ.get("LORAFUSE_CPU_LOW_PRECISION", "machine default")
    print(f"{len(rows)} steps ({args.seeds} seeds x {len(CASES)} cases x 3), branch: {branch}")
    floor = trainers.AUTOCAST_FLOOR
    for name, i in (("stock", 1), ("lorafuse", 0)):
        units = sorted(abs(row[i]) / abs(row[2]) / 2.0**-8 for row in rows)
        rms = math.sqrt(sum(row[i] ** 2 for row in rows) / len(rows))
        over = sum(u * 2.0**-8 > floor for u in units)
        print(f"{name:<9} RMS distance {rms:.2e}; largest five (x 2^-8 of the fp32 loss): "
              f"{', '.join(f'{u:.2f}' for u in units[-5:])}; above 2^-8: {sum(u > 1 for u in units)}, "
              f"above the test's floor ({floor / 2.0**-8:.0f} x 2^-8): {over}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
