"""One generation worker thread serving every request, one at a time, from a FIFO queue.

Why one worker: the model holds several PEFT adapters but only one is active at a time. Selecting
the adapter (``set_adapter`` / ``disable_adapter``) and generating inside the same thread, one
job after another, means outputs of different model ids can never mix. Each job streams its
events back to the asyncio side through ``loop.call_soon_threadsafe``; a job whose client went
away has its ``cancel`` event set and stops at the next token (or is skipped if still queued).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field

from lorafuse.generation import GenerationResult, SamplingParams, stream_generate
from lorafuse.models.resolve import use_adapter


@dataclass
class Job:
    """One request. ``adapter`` None = the bare base model. Events: ("delta", str), ("done", GenerationResult), ("error", str)."""

    adapter: str | None
    input_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


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
        result = GenerationResult()
        with use_adapter(self.model, job.adapter):
            gen = stream_generate(
                self.model, self.tokenizer, job.input_ids, job.params, job.cancel.is_set, result
            )
            for piece in gen:
                job.emit("delta", piece)
        if result.finish_reason == "cancelled":
            self.stats["cancelled"] += 1
            self.stats["last_cancelled_tokens"] = result.completion_tokens
        else:
            self.stats["completed"] += 1
        job.emit("done", result)
