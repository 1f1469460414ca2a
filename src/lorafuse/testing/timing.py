"""Timing for the benchmarks (``benchmarks/``): the one harness every benchmark and probe uses.

* :func:`median_time`: one function, the median of ``repeats`` timings after warm-up calls;
* :func:`interleaved_times` / :func:`interleaved_medians`: functions measured against each other,
  each round calling every one once, so a noisy shared machine's phases hit all of them alike
  (``rotate``: each round starts one function later, so none always runs right after the same
  neighbour, whose temporaries may have filled the cache);
* :func:`paired_ratio`: two functions timed back to back in alternating order, the median ratio;
* :func:`add_clock_arguments` / :func:`clock_from_args`: a benchmark's ``--threads`` / ``--clock``.

``clock`` is any ``time``-style clock: ``time.process_time`` counts this process's CPU seconds,
so with one thread the time spent descheduled by other work on the box drops out. ``device``:
on CUDA each timing synchronizes before starting and before stopping the clock.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable, clock, device, number: int = 1) -> float:
    _sync(device)
    t0 = clock()
    for _ in range(number):
        fn()
    _sync(device)
    return (clock() - t0) / number


def median_time(
    fn: Callable, repeats: int, warmup: int = 1, clock=time.perf_counter, device=None,
    number: int = 1,
) -> float:  # fmt: skip
    """Median seconds per call of ``fn`` over ``repeats`` timings of ``number`` calls each,
    after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(_timed(fn, clock, device, number) for _ in range(repeats))


def interleaved_times(
    fns: dict[str, Callable], repeats: int, warmup: int = 1, clock=time.perf_counter,
    rotate: bool = False, device=None,
) -> dict[str, list[float]]:  # fmt: skip
    """Seconds of every call, per function, over ``repeats`` rounds that call each once, after
    ``warmup`` rounds; with ``rotate`` round i starts from the i-th function."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(repeats):
        for k in range(len(names)):
            name = names[(i + k) % len(names) if rotate else k]
            times[name].append(_timed(fns[name], clock, device))
    return times


def interleaved_medians(
    fns: dict[str, Callable], repeats: int, warmup: int = 1, clock=time.perf_counter,
    rotate: bool = False, device=None,
) -> dict[str, float]:  # fmt: skip
    """Median seconds per function of :func:`interleaved_times` (same arguments)."""
    times = interleaved_times(fns, repeats, warmup, clock, rotate, device)
    return {k: statistics.median(v) for k, v in times.items()}


def paired_ratio(
    reference: Callable, candidate: Callable, repeats: int, clock=time.perf_counter
) -> float:
    """Median over ``repeats`` pairs of reference seconds / candidate seconds (> 1: the candidate
    is faster). Each pair warms both, then times two calls of each back to back, the order
    alternating, so a change of the machine's speed during the run hits both sides alike."""

    def twice(fn) -> float:
        return _timed(fn, clock, None, number=2)

    ratios = []
    for i in range(repeats):
        reference(), candidate()  # warm both
        if i % 2:
            a, b = twice(reference), twice(candidate)
        else:
            b, a = twice(candidate), twice(reference)
        ratios.append(a / b)
    return statistics.median(ratios)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for a benchmark's header line."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def add_clock_arguments(parser: argparse.ArgumentParser, threads: int = 2) -> None:
    """``--threads`` and ``--clock wall | cpu`` on a benchmark's parser."""
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time (time.process_time; with --threads 1 "
                        "it drops the time spent descheduled on a shared machine)")  # fmt: skip


def clock_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable:
    """Sets torch's thread count and returns the clock ``args`` ask for (cpu: one thread only,
    since process time adds every thread's seconds)."""
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu counts every thread's time: use it with --threads 1")
    torch.set_num_threads(args.threads)
    return time.process_time if args.clock == "cpu" else time.perf_counter
