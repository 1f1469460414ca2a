"""The benchmarks' timing harness, on a fake clock: which calls it times, in which order, and what
it reports (no real timing here)."""

from __future__ import annotations

import pytest

from lorafuse.testing.timing import (
    interleaved_medians,
    interleaved_times,
    median_time,
    paired_ratio,
)


class FakeClock:
    """A clock that only moves when a timed function says it ran for some seconds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def costing(self, *seconds: float, log: list | None = None, name: str = ""):
        """A function whose k-th call takes ``seconds[k % len(seconds)]``."""
        calls = []

        def fn():
            self.now += seconds[len(calls) % len(seconds)]
            calls.append(1)
            if log is not None:
                log.append(name)

        fn.calls = calls
        return fn


def test_median_time_warms_up_then_takes_the_median_per_call():
    clock = FakeClock()
    fn = clock.costing(100.0, 1.0, 5.0, 3.0, 2.0)  # the first call is the warm-up
    assert median_time(fn, 4, warmup=1, clock=clock) == 2.5  # median of 1, 5, 3, 2
    assert len(fn.calls) == 5
    fn = clock.costing(1.0, 3.0)
    # number=2: each timing covers two calls and reports seconds per call
    assert median_time(fn, 3, warmup=0, clock=clock, number=2) == 2.0
    assert len(fn.calls) == 6


def test_interleaved_rounds_call_each_once_in_order_or_rotated():
    clock, log = FakeClock(), []
    fns = {n: clock.costing(1.0, log=log, name=n) for n in "abc"}
    interleaved_times(fns, 3, warmup=1, clock=clock)
    assert "".join(log) == "abc" + "abc" * 3
    log.clear()
    interleaved_times(fns, 3, warmup=0, clock=clock, rotate=True)
    assert "".join(log) == "abcbcacab"


def test_interleaved_medians_are_each_functions_own():
    clock = FakeClock()
    fns = {"fast": clock.costing(1.0, 2.0, 9.0), "slow": clock.costing(10.0, 20.0, 30.0)}
    times = interleaved_times(fns, 3, warmup=0, clock=clock)
    assert times == {"fast": [1.0, 2.0, 9.0], "slow": [10.0, 20.0, 30.0]}
    clock = FakeClock()
    fns = {"fast": clock.costing(1.0, 2.0, 9.0), "slow": clock.costing(10.0, 20.0, 30.0)}
    assert interleaved_medians(fns, 3, warmup=0, clock=clock) == {"fast": 2.0, "slow": 20.0}


def test_paired_ratio_is_reference_over_candidate_whatever_the_order():
    clock, log = FakeClock(), []
    reference = clock.costing(6.0, log=log, name="r")
    candidate = clock.costing(2.0, log=log, name="c")
    assert paired_ratio(reference, candidate, 4, clock=clock) == pytest.approx(3.0)
    # each pair warms both, then times two calls of each, the first side alternating
    assert "".join(log) == "rcccrrrcrrccrcccrrrcrrcc"
