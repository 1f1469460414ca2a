"""One generation worker thread serving every request, one at a time, from a FIFO queue.

Why one worker: the model holds several PEFT adapters but only one is active at a time. Selecting
the adapter (``set_adapter`` / ``disable_adapter``) and generating inside the same thread, one
job after another, means outputs of different model ids can never mix. Each job streams its
events back to the asyncio side through ``loop.call_soon_threadsafe``; a job whose client went
away has its ``cancel`` event set and stops at the next token (or is skipped if still queued).
The choices of one request (``n``, a list of prompts) are separate jobs sharing one event queue,
each event tagged with its choice ``index``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field

from lorafuse.generation import GenerationResult, SamplingParams, stream_generate
from lorafuse.models.resolve import use_adapter
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

    def emit(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, payload))


class GenerationWorker:
    def __init__(self, model, tokenizer, max_queue: int = 64):
        self.model, self.tokenizer = model, tokenizer
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.busy = False
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "last_cancelled_tokens": None}
        self.thread = threading.Thread(target=self._loop, name="lorafuse-generate", daemon=True)
        self.thread.start()

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

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancel.is_set():  # client left while queued
                self.stats["cancelled"] += 1
                continue
            self.busy = True
            try:
                self._run(job)
            except Exception as err:  # report to the client; the worker keeps serving
                self.stats["failed"] += 1
                traceback.print_exc()
                job.emit("error", f"{type(err).__name__}: {err}")
            finally:
                self.busy = False

    def _run(self, job: Job) -> None:
        result, pending = GenerationResult(), []
        k = job.logprobs

        def on_token(token, logits):  # entries wait for the text piece that shows them
            pending.append(token_entry(self.tokenizer, token, logits, k))

        with use_adapter(self.model, job.adapter):
            if job.echo:
                entries = prompt_entries(self.model, self.tokenizer, job.input_ids, k or 0)
                job.emit("prompt", entries if k is not None else [])
            result.prompt_tokens, gen = len(job.input_ids), iter(())
            if job.generate:
                gen = stream_generate(self.model, self.tokenizer, job.input_ids, job.params,
                                      job.cancel.is_set, result, on_token if k is not None else None)  # fmt: skip
            for piece in gen:
                job.emit("delta", (piece, pending[:]))
                pending.clear()
            if pending:  # tokens that show no text: an ending EOS, a token cut by a stop string
                job.emit("delta", ("", pending[:]))
        if result.finish_reason == "cancelled":
            self.stats["cancelled"] += 1
            self.stats["last_cancelled_tokens"] = result.completion_tokens
        else:
            self.stats["completed"] += 1
        job.emit("done", result)
