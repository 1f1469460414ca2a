"""One generation thread that serves every request by continuous batching of decoding steps.

Jobs wait in a FIFO queue (``--max-queue``). Between two decoding steps the scheduler admits
waiting jobs while fewer than ``max_batch`` sequences run: each is prefilled alone, draws its
first token, and joins the running batch. With the decode engine (``engine``: where it runs the
model) that is one :class:`lorafuse.serve.engine_batch.EngineBatch` for every adapter: each step
is one engine call for all running sequences, each row with its own adapter unmerged. Without
it, each adapter has its own :class:`lorafuse.serve.batch.PaddedBatch` and every step is one
model forward per adapter with sequences (PEFT activates one adapter at a time, so sequences of
different model ids never share a forward and their outputs cannot mix). Each sequence keeps its
own sampling, penalties, ``logit_bias``, stops, length and logprobs
(:class:`lorafuse.generation.TokenStream`) and leaves the batch when done or when its client went
away (``cancel`` set), which frees its slot.

Events go back to the asyncio side through ``loop.call_soon_threadsafe``. The choices of one
request (``n``, a list of prompts) are separate jobs sharing one event queue, each event tagged
with its choice ``index``; they run side by side in the batch.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field

import torch

from lorafuse.generation import CACHE_KW, GenerationResult, SamplingParams, TokenStream
from lorafuse.models.resolve import use_adapter
from lorafuse.serve.batch import PaddedBatch, batchable
from lorafuse.serve.engine_batch import EngineBatch
from lorafuse.serve.logprobs import prompt_entries, token_entry


@dataclass
class Job:
    """One choice of a request. ``adapter`` None = the bare base model. ``logprobs``: None = off,
    else how many top alternatives per token; ``echo``: first send the prompt's entries.
    Events ``(index, kind, payload)``: ("prompt", entries), ("delta", (text, entries)),
    ("done", GenerationResult), ("error", str); entries are empty when logprobs is off."""

    adapter: str | None
    input_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    index: int = 0
    logprobs: int | None = None
    echo: bool = False
    generate: bool = True  # False: echo only (max_tokens=0), the prompt scored, nothing generated
    cancel: threading.Event = field(default_factory=threading.Event)
    inputs: dict | None = None  # the prompt's image tensors (vision-language models)

    def emit(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, payload))


@dataclass
class Sequence:
    """A running job: its token stream and the logprob entries not yet sent with a text piece."""

    job: Job
    stream: TokenStream
    result: GenerationResult
    pending: list = field(default_factory=list)

    def send(self, piece: str) -> None:
        if piece:
            self.job.emit("delta", (piece, self.pending[:]))
            self.pending.clear()
        if self.stream.done and self.pending:  # no text: an ending EOS, a token cut by a stop
            self.job.emit("delta", ("", self.pending[:]))
            self.pending.clear()


_ENGINE = object()  # the key of the engine batch in ``groups``


class GenerationWorker:
    """``max_batch``: most sequences decoded together (1 = one at a time). ``batchable`` False
    (a vision-language model) keeps it to one whatever ``max_batch`` says. ``start`` False: the
    thread waits for :meth:`start` (a test queues jobs first, so they arrive together).
    ``engine``: a :class:`lorafuse.decode.DecodeEngine` of ``model`` (None: the model's forward;
    jobs with image inputs always take it)."""

    def __init__(self, model, tokenizer, max_queue: int = 64, max_batch: int = 8,
                 batchable: bool = True, start: bool = True, engine=None):  # fmt: skip
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.max_batch, self.may_batch = max(1, max_batch), batchable
        self.groups: dict[object, PaddedBatch | EngineBatch] = {}
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "last_cancelled_tokens": None,
                      "running": 0, "decode_steps": 0, "batched_steps": 0, "peak_batch": 0}  # fmt: skip
        self.thread = threading.Thread(target=self._loop, name="lorafuse-generate", daemon=True)
        if start:
            self.thread.start()

    def start(self) -> None:
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self.stats["running"] > 0

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    def submit_all(self, jobs: list[Job]) -> bool:
        """Queue all of a request's jobs or none (only the event loop submits, so room only grows)."""
        if self.jobs.maxsize - self.jobs.qsize() < len(jobs):
            return False
        for job in jobs:
            self.jobs.put_nowait(job)
        return True

    def queue_depth(self) -> int:
        return self.jobs.qsize()

    def stop(self) -> None:
        self.jobs.put(None)

    def _running(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def _loop(self) -> None:
        with torch.inference_mode():
            while self._admit():
                for adapter in list(self.groups):
                    self._step(adapter)
                self.stats["running"] = self._running()

    def _admit(self) -> bool:
        """Start waiting jobs while there is room (blocking only when nothing runs); False once
        ``stop`` was called."""
        while self._running() < (self.max_batch if self.may_batch else 1):
            try:
                job = self.jobs.get(block=self._running() == 0)
            except queue.Empty:
                return True
            if job is None:
                return False
            if job.cancel.is_set():  # client left while queued
                self.stats["cancelled"] += 1
                continue
            try:
                self._start(job)
            except Exception as err:  # report to the client; the worker keeps serving
                self._fail([job], err)
            self.stats["running"] = self._running()
        return True

    def _start(self, job: Job) -> None:
        """Prefill ``job`` alone, draw its first token, and join its adapter's batch."""
        result, k, pending = GenerationResult(prompt_tokens=len(job.input_ids)), job.logprobs, []
        on_token = None
        if k is not None:  # entries wait for the text piece that shows them

            def on_token(token, logits):
                pending.append(token_entry(self.tokenizer, token, logits, k))

        stream = TokenStream(self.model, self.tokenizer, job.params, result, on_token)
        seq = Sequence(job, stream, result, pending)
        if self.engine is not None and not job.inputs:
            return self._start_on_engine(seq)
        device = next(self.model.parameters()).device
        with use_adapter(self.model, job.adapter):
            if job.echo:
                entries = prompt_entries(self.model, self.tokenizer, job.input_ids, k or 0)
                job.emit("prompt", entries if k is not None else [])
            if not job.generate:
                return self._finish(seq)
            inputs = {key: v.to(device) for key, v in (job.inputs or {}).items()}
            ids = torch.tensor([job.input_ids], device=device)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **inputs)
        seq.send(seq.stream.push(out.logits[0, -1].float().cpu()))
        if seq.stream.done:
            return self._finish(seq)
        cache = getattr(out, CACHE_KW)
        self.may_batch = self.may_batch and batchable(cache)
        self.groups.setdefault(job.adapter, PaddedBatch()).join(seq, cache, len(job.input_ids))

    def _start_on_engine(self, seq: Sequence) -> None:
        """:meth:`_start` on the decode engine: one prefill gives the prompt's entries (echo)
        and the first token's logits."""
        job, k, engine = seq.job, seq.job.logprobs, self.engine
        reserve = len(job.input_ids) + (job.params.max_new_tokens if job.generate else 0)
        handle = engine.open(job.adapter, reserve)
        try:
            logits = engine.prefill(handle, job.input_ids, all_logits=job.echo)
        except Exception:
            engine.close(handle)
            raise
        if job.echo:
            entries = prompt_entries(self.model, self.tokenizer, job.input_ids, k or 0, logits)
            job.emit("prompt", entries if k is not None else [])
            logits = logits[-1]
        if not job.generate:
            engine.close(handle)
            return self._finish(seq)
        seq.send(seq.stream.push(logits))
        if seq.stream.done:
            engine.close(handle)
            return self._finish(seq)
        self.groups.setdefault(_ENGINE, EngineBatch(engine)).join(seq, handle)

    def _forward(self, key, group) -> torch.Tensor:
        tokens = [s.stream.last_token for s in group.rows]
        if key is _ENGINE:
            return group.step(tokens)
        with use_adapter(self.model, key):
            return group.step(self.model, tokens)

    def _step(self, adapter: str | None) -> None:
        group = self.groups[adapter]
        gone = {i for i, seq in enumerate(group.rows) if seq.job.cancel.is_set()}
        for i in gone:
            group.rows[i].result.finish_reason = "cancelled"
            self._finish(group.rows[i])
        group.drop(gone)
        if group:
            self.stats["decode_steps"] += 1
            self.stats["batched_steps"] += len(group) > 1
            self.stats["peak_batch"] = max(self.stats["peak_batch"], len(group))
            try:
                logits = self._forward(adapter, group)
            except Exception as err:  # every sequence of this forward fails; the rest go on
                self._fail([s.job for s in group.rows], err)
                group.drop(set(range(len(group))))
                del self.groups[adapter]
                return
            gone = set()
            for i, seq in enumerate(group.rows):
                seq.send(seq.stream.push(logits[i]))
                if seq.stream.done:
                    self._finish(seq)
                    gone.add(i)
            group.drop(gone)
        if not group:
            del self.groups[adapter]

    def _finish(self, seq: Sequence) -> None:
        if seq.result.finish_reason == "cancelled":
            self.stats["cancelled"] += 1
            self.stats["last_cancelled_tokens"] = seq.result.completion_tokens
        else:
            self.stats["completed"] += 1
        seq.job.emit("done", seq.result)

    def _fail(self, jobs: list[Job], err: Exception) -> None:
        traceback.print_exc()
        for job in jobs:
            self.stats["failed"] += 1
            job.emit("error", f"{type(err).__name__}: {err}")
