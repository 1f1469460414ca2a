"""Timing for the benchmarks: functions measured against each other, interleaved."""

from __future__ import annotations

import statistics
import time


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per function over ``repeats`` rounds that call each once, after one
    warmup call each: interleaved, so a noisy shared machine's phases hit all of them alike."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
