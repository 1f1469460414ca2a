"""Continuous batching in serve's worker: requests decoded together give what they give alone.

The worker is driven in-process (no HTTP) on the tiny Llama with two adapters, fp32: the "alone"
oracle is the same worker with ``max_batch=1`` (each job prefilled and stepped by itself, the
path of ``stream_generate``); the batched run queues every job before the thread starts, so they
are admitted together, and the worker's ``peak_batch`` counter shows they shared forwards. The
model's forward (padded batches per adapter) and the decode engine (one batch for every adapter)
are both checked.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from lorafuse import decode
from lorafuse.generation import SamplingParams, encode_prompt
from lorafuse.serve.worker import GenerationWorker, Job
from lorafuse.testing.numerics import assert_close, rms_error

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "What is the capital of France? The capital of France is",
    "0123",
]


def _load(tiny_ws, dtype):
    from lorafuse.models.resolve import ModelSpec, load_resolved

    spec = ModelSpec(str(tiny_ws["base"]), {"a": str(tiny_ws["adapter_a"]),
                                            "b": str(tiny_ws["adapter_b"])})  # fmt: skip
    model, tok, _ = load_resolved(spec, dtype=dtype)
    return model, tok


@pytest.fixture(scope="module")
def served(tiny_ws):
    """fp64: rounding is too small to hide a wrong position, mask or cache row."""
    return _load(tiny_ws, torch.float64)


@pytest.fixture(scope="module")
def served32(tiny_ws):
    return _load(tiny_ws, torch.float32)


def run(served, specs: list[dict], max_batch: int, cancel_first_after: int | None = None,
        engine=None, echo: bool = False):  # fmt: skip
    """Queue one job per spec (keys: adapter, prompt, and SamplingParams fields), start a
    worker, and collect each job's text, token entries and result; also the worker's stats.
    ``engine``: "auto" runs the worker on the model's decode engine."""
    model, tok = served
    engine = decode.engine_for(model) if engine == "auto" else engine
    worker = GenerationWorker(model, tok, max_batch=max_batch, start=False, engine=engine)
    order = []  # job indices in the order they finished

    async def drain(job: Job, cancel_after: int | None) -> dict:
        text, entries, deltas, prompt = [], [], 0, None
        while True:
            _, kind, payload = await job.events.get()
            if kind == "prompt":
                prompt = payload
            elif kind == "delta":
                text.append(payload[0])
                entries.extend(payload[1])
                deltas += 1
                if cancel_after is not None and deltas >= cancel_after:
                    job.cancel.set()
            elif kind == "done":
                order.append(job.index)
                return {"text": "".join(text), "entries": entries, "result": payload,
                        "prompt": prompt}  # fmt: skip
            elif kind == "error":
                raise AssertionError(payload)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = []
        for i, s in enumerate(specs):
            s = dict(s)
            adapter, prompt = s.pop("adapter"), s.pop("prompt")
            jobs.append(Job(adapter, encode_prompt(tok, prompt), SamplingParams(**s), loop,
                            asyncio.Queue(), index=i, logprobs=2, echo=echo))  # fmt: skip
        assert worker.submit_all(jobs)
        worker.start()
        cancels = [cancel_first_after] + [None] * (len(jobs) - 1)
        return await asyncio.gather(*(drain(j, c) for j, c in zip(jobs, cancels)))

    try:
        results = asyncio.run(main())
    finally:
        worker.stop()
        worker.thread.join(10)
    return results, {**worker.stats, "order": order}


def alone(served, specs, engine=None, echo=False):
    return [run(served, [s], max_batch=1, engine=engine, echo=echo)[0][0] for s in specs]


def _logprobs(entries: list[dict]) -> torch.Tensor:
    return torch.tensor(
        [[e["logprob"]] + [lp for _, lp in e["top"]] for e in entries], dtype=torch.float64
    )


def assert_same(batched: dict, solo: dict) -> None:
    assert batched["text"] == solo["text"]
    assert [e["token"] for e in batched["entries"]] == [e["token"] for e in solo["entries"]]
    assert [[t for t, _ in e["top"]] for e in batched["entries"]] == [
        [t for t, _ in e["top"]] for e in solo["entries"]
    ]
    # fp64: a padded, masked batch row and the sequence alone differ in summation order at most
    assert_close(_logprobs(batched["entries"]), _logprobs(solo["entries"]), atol=1e-12, rtol=1e-12,
                 name="logprobs")  # fmt: skip
    r, w = batched["result"], solo["result"]
    assert (r.completion_tokens, r.finish_reason, r.text) == (w.completion_tokens, w.finish_reason, w.text)  # fmt: skip


def test_greedy_batch_equals_each_request_alone(served):
    """Different prompt lengths, max_tokens, adapters (one forward per adapter per step)."""
    specs = [
        {"adapter": None, "prompt": PROMPTS[0], "max_new_tokens": 12, "ignore_eos": True},
        {"adapter": None, "prompt": PROMPTS[1], "max_new_tokens": 5, "ignore_eos": True},
        {"adapter": None, "prompt": PROMPTS[2], "max_new_tokens": 20, "ignore_eos": True},
        {"adapter": "a", "prompt": PROMPTS[3], "max_new_tokens": 9, "ignore_eos": True},
        {"adapter": "a", "prompt": PROMPTS[0], "max_new_tokens": 14},
        {"adapter": "b", "prompt": PROMPTS[2], "max_new_tokens": 7, "ignore_eos": True,
         "frequency_penalty": 1.5, "logit_bias": {5: 4.0}},
    ]  # fmt: skip
    batched, stats = run(served, specs, max_batch=8)
    for got, want in zip(batched, alone(served, specs)):
        assert_same(got, want)
    assert [r["result"].completion_tokens for r in batched][:4] == [12, 5, 20, 9]
    assert stats["peak_batch"] == 3 and stats["batched_steps"] > 0  # three base rows shared steps
    assert stats["completed"] == len(specs) and stats["running"] == 0


def test_fp32_batch_is_as_accurate_as_alone(served, served32):
    """What serve runs: fp32. A batch row and the same request alone round differently (the
    (B, hidden) products and the masked attention sum in another order): on this tiny model
    both are ~4e-5 from fp64 at worst, so they are not compared with each other at 1e-5; each
    is compared with the fp64 oracle and the batch may be at most 1.5x as far (rms) as alone."""
    specs = [{"adapter": a, "prompt": p, "max_new_tokens": n, "ignore_eos": True}
             for a, p, n in [(None, PROMPTS[0], 12), (None, PROMPTS[1], 5), (None, PROMPTS[2], 20),
                             ("a", PROMPTS[3], 9), ("a", PROMPTS[2], 9)]]  # fmt: skip
    oracle = alone(served, specs)
    batched, stats = run(served32, specs, max_batch=8)
    solo = alone(served32, specs)
    assert stats["peak_batch"] == 3
    for b, s, o in zip(batched, solo, oracle):
        assert b["text"] == s["text"] == o["text"]
        assert [e["token"] for e in b["entries"]] == [e["token"] for e in o["entries"]]
    got, alone_, want = (
        torch.cat([_logprobs(r["entries"]) for r in rs]) for rs in (batched, solo, oracle)
    )
    assert rms_error(got, want.double()) <= 1.5 * rms_error(alone_, want.double())


def test_seeded_sampling_reproduces_in_a_batch(served):
    kw = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 40,
          "ignore_eos": True}  # fmt: skip
    specs = [{"adapter": "a", "prompt": p, "seed": i, **kw} for i, p in enumerate(PROMPTS)]
    batched, stats = run(served, specs, max_batch=4)
    again, _ = run(served, specs, max_batch=4)
    solo = alone(served, specs)
    assert [b["text"] for b in batched] == [a["text"] for a in again] == [s["text"] for s in solo]
    assert len({b["text"] for b in batched}) > 1 and stats["peak_batch"] == 4


def test_a_stop_string_ends_only_its_own_request(served):
    base = {"adapter": "a", "prompt": PROMPTS[2], "max_new_tokens": 16, "ignore_eos": True}
    full = alone(served, [base])[0]["text"]
    stop = full[4:7]  # taken from the known output: that request must end right before it
    batched, stats = run(served, [{**base, "stop": [stop]}, base], max_batch=2)
    assert batched[0]["text"] == full[: full.find(stop)]
    assert batched[0]["result"].finish_reason == "stop"
    assert batched[1]["text"] == full and batched[1]["result"].finish_reason == "length"
    assert stats["peak_batch"] == 2


def test_a_cancelled_sequence_frees_its_slot(served):
    """Two slots, three requests: the third waits for a slot; cancelling the first frees one,
    so the third (6 tokens) ends before the second (150 tokens) although it started last."""
    long = {"adapter": None, "prompt": PROMPTS[0], "max_new_tokens": 400, "ignore_eos": True}
    short = {"adapter": None, "prompt": PROMPTS[1], "max_new_tokens": 6, "ignore_eos": True}
    results, stats = run(served, [long, {**long, "max_new_tokens": 150}, short], max_batch=2,
                         cancel_first_after=3)  # fmt: skip
    cancelled, other, waited = (r["result"] for r in results)
    assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens < 400
    assert other.completion_tokens == 150 and waited.completion_tokens == 6
    assert stats["order"] == [0, 2, 1]
    assert stats["cancelled"] == 1 and stats["completed"] == 2 and stats["peak_batch"] == 2
    assert results[2]["text"] == alone(served, [short])[0]["text"]


MIXED = [
    {"adapter": None, "prompt": PROMPTS[0], "max_new_tokens": 12, "ignore_eos": True},
    {"adapter": "a", "prompt": PROMPTS[1], "max_new_tokens": 5, "ignore_eos": True},
    {"adapter": "b", "prompt": PROMPTS[2], "max_new_tokens": 20, "ignore_eos": True,
     "frequency_penalty": 1.5, "logit_bias": {5: 4.0}},
    {"adapter": "a", "prompt": PROMPTS[3], "max_new_tokens": 9, "ignore_eos": True},
    {"adapter": "b", "prompt": PROMPTS[0], "max_new_tokens": 14},
    {"adapter": None, "prompt": PROMPTS[2], "max_new_tokens": 7, "ignore_eos": True,
     "stop": ["{"]},  # its text alone is '\x0b{?...': the stop ends it at 1 token
]  # fmt: skip


def test_engine_batch_of_every_adapter_equals_each_request_alone(served32):
    """On the decode engine every adapter shares one step (peak_batch = all six requests), and
    each request's tokens, logprobs (bit for bit: a row's sums do not depend on the other rows)
    and echoed prompt entries equal the request alone on the engine."""
    batched, stats = run(served32, MIXED, max_batch=8, engine="auto", echo=True)
    for got, want in zip(batched, alone(served32, MIXED, engine="auto", echo=True)):
        assert got["text"] == want["text"] and got["prompt"] == want["prompt"]
        assert_close(_logprobs(got["entries"]), _logprobs(want["entries"]), atol=0, rtol=0,
                     name="logprobs")  # fmt: skip
        assert got["result"].finish_reason == want["result"].finish_reason
    assert stats["peak_batch"] == len(MIXED) and stats["completed"] == len(MIXED)
    assert batched[5]["result"].finish_reason == "stop" and batched[5]["text"] == "\x0b"


def test_engine_is_as_accurate_as_the_model_forward(served, served32):
    """fp32 on the engine against the fp64 model forward: the same tokens and top-2 ids, and
    logprobs no farther (rms) than the fp32 model forward's own."""
    oracle = alone(served, MIXED)
    engine, _ = run(served32, MIXED, max_batch=8, engine="auto")
    stock = alone(served32, MIXED)
    for e, o in zip(engine, oracle):
        assert e["text"] == o["text"]
        assert [x["token"] for x in e["entries"]] == [x["token"] for x in o["entries"]]
    got, base, want = (torch.cat([_logprobs(r["entries"]) for r in rs])
                       for rs in (engine, stock, oracle))  # fmt: skip
    assert rms_error(got, want) <= 1.5 * rms_error(base, want)


def test_engine_cancel_frees_the_slot(served32):
    long = {"adapter": "a", "prompt": PROMPTS[0], "max_new_tokens": 400, "ignore_eos": True}
    short = {"adapter": None, "prompt": PROMPTS[1], "max_new_tokens": 6, "ignore_eos": True}
    results, stats = run(served32, [long, {**long, "max_new_tokens": 150}, short], max_batch=2,
                         cancel_first_after=3, engine="auto")  # fmt: skip
    assert stats["order"] == [0, 2, 1] and stats["cancelled"] == 1
    assert results[2]["text"] == alone(served32, [short], engine="auto")[0]["text"]
