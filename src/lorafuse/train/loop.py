"""The loop shell every trainer runs in: :func:`run_loop` drives a :class:`Runner`.

A runner (the engine's :class:`~lorafuse.train.engine.Trainer`, its GRPO subclass, the image
trainer) makes one optimizer step, evaluates, writes a checkpoint and names its own summary
fields. The shell owns everything around the step, the same way for all of them:

* stop signals: Ctrl-C or SIGTERM (``kill``, the web UI's Stop) -> a checkpoint after this step,
  then :class:`TrainingInterrupted` (a second Ctrl-C quits without saving); any rank's signal
  stops every rank;
* cadence: a ``logging.jsonl`` record and the progress bar every ``logging_steps`` and at the last
  step; evaluation every ``eval_steps`` and at the end; a checkpoint every ``save_steps`` and at
  the end, keeping the newest ``save_total_limit``;
* one-line errors: out of memory (the runner says what to lower), a full disk (the last good
  checkpoint), a non-finite loss (:meth:`Runner.check_finite`); each names the last checkpoint;
* ``<output_dir>/status.json`` (:mod:`lorafuse.train.status`): running, finished, interrupted
  (with the checkpoint to resume) or failed (with the one-line error);
* the final summary table.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch

from lorafuse import files, heap
from lorafuse.errors import LorafuseError
from lorafuse.train import checkpoint as ckpt
from lorafuse.train import distributed as dist
from lorafuse.train.monitor import Monitor, format_summary, peak_memory_mb
from lorafuse.train.status import RunStatus

DEBUG_SLEEP_ENV = "LORAFUSE_DEBUG_STEP_SLEEP"  # seconds to sleep per step: lets tests kill mid-run
NO_CHECKPOINT = "none (no checkpoint was written yet)"


class TrainingError(LorafuseError, RuntimeError):
    """Training cannot continue (non-finite loss, mismatched checkpoint...); the message says why."""


class TrainingInterrupted(Exception):
    """Ctrl-C or SIGTERM: a checkpoint was saved at ``path``."""

    def __init__(self, path: str, step: int) -> None:
        super().__init__(
            f"interrupted at step {step}; checkpoint saved to {path} (continue with --resume {path})"
        )
        self.path = path
        self.step = step


@dataclass(frozen=True)
class Cadence:
    """Where a run writes and how often the shell logs, evaluates and saves (0 = never)."""

    output_dir: str
    logging_steps: int
    save_steps: int
    save_total_limit: int  # 0: keep every checkpoint
    eval_steps: int = 0
    progress: bool = True
    report_to: tuple[str, ...] = ()  # trackers (lorafuse.train.trackers)
    config: dict | None = None  # the resolved settings, the trackers' run parameters


@dataclass
class Totals:
    """What the shell counts over the steps this process ran (a resumed run: since the resume)."""

    started: float = field(default_factory=time.perf_counter)
    train_time: float = 0.0  # step time only (forward, backward, optimizer): no eval, no saving
    examples: int = 0
    tokens: int | None = None  # None: the runner counts no tokens (images)
    loss_sum: float = 0.0
    steps_run: int = 0
    last_loss: float | None = None  # of the last logged step


class Runner:
    """What a trainer gives the shell. Subclasses set ``ctx`` (:class:`dist.DistContext`),
    ``step``, ``total_steps``, ``steps_per_epoch`` and implement :meth:`setup`, :meth:`cadence`,
    :meth:`train_step`, :meth:`save`, :meth:`out_of_memory` and :meth:`summary_fields`.

    :meth:`train_step` makes one optimizer step, advances ``step`` and returns its figures:
    ``loss``, ``lr``, ``grad_norm``, ``examples``; optionally ``tokens`` (then the log and the
    summary carry tokens/s) and ``metrics`` (added to the log record).
    """

    EVAL_KEY: str | None = "eval_loss"  # the log/summary key of evaluate(); None: no evaluation
    NONFINITE_ADVICE = "Try a lower lr or max_grad_norm > 0."
    ctx: dist.DistContext
    step: int
    total_steps: int
    steps_per_epoch: int
    last_checkpoint: str | None = None  # set by the shell after each full checkpoint
    monitor: Monitor | None = None  # set by the shell while the loop runs
    heap_policy: heap.HeapPolicy | None = None  # the CPU heap policy setup applied, if any

    def setup(self) -> None:
        """Load the model and data, restore a checkpoint: everything before the first step."""
        raise NotImplementedError

    def cadence(self) -> Cadence:
        raise NotImplementedError

    def train_step(self) -> dict:
        raise NotImplementedError

    def evaluate(self) -> float | None:
        """The eval figure (``EVAL_KEY``), or None where there is nothing to evaluate."""
        return None

    def after_step(self, last: bool) -> None:
        """Runs after the step's log and eval, before its checkpoint (image samples)."""

    def save(self, name: str, full_state: bool) -> str:
        """Write checkpoint ``name`` (full_state: resumable); every rank calls it."""
        raise NotImplementedError

    def out_of_memory(self, err: BaseException) -> str:
        """``out of memory at step N (where; ...): lower ...`` (the shell adds the checkpoint)."""
        raise NotImplementedError

    def summary_fields(self, final: str, totals: Totals) -> dict:
        """The runner's own summary entries (after the shell's), ``final`` the final save."""
        return {}

    def run(self, status: RunStatus | None = None) -> dict:
        """The loop; returns the summary (see :func:`run_loop`)."""
        return run_loop(self, status)

    def say(self, msg: str) -> None:
        """A line for people (through the progress bar while it is shown); main rank only."""
        if not dist.is_main(self.ctx):
            return
        if self.monitor is not None and self.monitor.enabled:
            self.monitor.write(f"lorafuse: {msg}")
        else:
            print(f"lorafuse: {msg}", file=sys.stderr, flush=True)

    def last_good(self) -> str:
        return self.last_checkpoint or NO_CHECKPOINT

    def check_finite(self, what: str, value: float) -> None:
        """Stop before an update whose ``what`` (loss, gradient norm) is NaN or infinite."""
        if not math.isfinite(value):
            raise TrainingError(
                f"non-finite {what} ({value}) at step {self.step + 1}: stopping without applying "
                f"this update. Last good checkpoint: {self.last_good()}. {self.NONFINITE_ADVICE}"
            )


class _StopSignals:
    """SIGINT / SIGTERM handlers for the loop's duration: ask for a checkpoint and a stop."""

    def __init__(self, say) -> None:
        self.say = say
        self.requested = False

    def __enter__(self) -> _StopSignals:
        self.old = {s: signal.signal(s, self._on) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)

    def _on(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:  # second Ctrl-C: quit, no checkpoint
            raise KeyboardInterrupt
        self.requested = True
        what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        self.say(f"{what}: saving a checkpoint after this step (Ctrl-C again quits without saving)")


def checkpoint(runner: Runner, cad: Cadence) -> str:
    """A full (resumable) checkpoint of this step; older ones beyond ``save_total_limit`` go."""
    path = runner.save(f"checkpoint-{runner.step}", full_state=True)
    if dist.is_main(runner.ctx):
        ckpt.rotate(cad.output_dir, cad.save_total_limit)
    runner.last_checkpoint = path
    return path


def _step(runner: Runner, totals: Totals) -> tuple[dict, float]:
    """One step, timed; running out of memory becomes one line."""
    t0 = time.perf_counter()
    try:
        fig = runner.train_step()
    except (MemoryError, torch.OutOfMemoryError) as err:
        raise TrainingError(
            f"{runner.out_of_memory(err)}. Last good checkpoint: {runner.last_good()}"
        ) from err
    dt = time.perf_counter() - t0
    totals.train_time += dt
    totals.examples += fig["examples"]
    if "tokens" in fig:
        totals.tokens = (totals.tokens or 0) + fig["tokens"]
    totals.loss_sum += fig["loss"]
    totals.steps_run += 1
    return fig, dt


def _record(runner: Runner, fig: dict, window: dict, totals: Totals) -> dict:
    """The log record of this step; ``window`` holds time/examples/tokens since the last one."""
    ctx, dt = runner.ctx, window["dt"]
    record = {"step": runner.step, "epoch": round(runner.step / runner.steps_per_epoch, 4),
              "loss": fig["loss"], "lr": fig["lr"], "grad_norm": fig["grad_norm"]}  # fmt: skip
    if "tokens" in fig:
        record["tokens_per_s"] = dist.throughput(window["tokens"], dt, ctx)[1]
    record.update(samples_per_s=window["examples"] / max(dt, 1e-9),
                  peak_mem_mb=peak_memory_mb(ctx.device),
                  elapsed_s=time.perf_counter() - totals.started)  # fmt: skip
    record.update(fig.get("metrics", {}))  # dpo/orpo/kto/grpo: rewards, margins, accuracy...
    totals.last_loss = fig["loss"]
    return record


def run_loop(runner: Runner, status: RunStatus | None = None) -> dict:
    """Step ``runner`` from its ``step`` to ``total_steps``; returns the summary."""
    cad = runner.cadence()
    main = dist.is_main(runner.ctx)
    status = status or RunStatus(cad.output_dir, enabled=False)
    status.update(state="running", step=runner.step, total_steps=runner.total_steps)
    runner.monitor = mon = Monitor(cad.output_dir, runner.total_steps, runner.step, enabled=main,
                                   progress=cad.progress, report_to=cad.report_to,
                                   config=cad.config)  # fmt: skip
    sleep = float(os.environ.get(DEBUG_SLEEP_ENV, "0") or 0)
    totals = Totals()
    window = {"dt": 0.0, "examples": 0, "tokens": 0}
    try:
        with _StopSignals(runner.say) as stop:
            while runner.step < runner.total_steps:
                fig, dt = _step(runner, totals)
                window = {"dt": window["dt"] + dt, "examples": window["examples"] + fig["examples"],
                          "tokens": window["tokens"] + fig.get("tokens", 0)}  # fmt: skip
                mon.step_done()
                last = runner.step == runner.total_steps
                if runner.step % cad.logging_steps == 0 or last:
                    mon.log(_record(runner, fig, window, totals))
                    status.update(step=runner.step)
                    window = {"dt": 0.0, "examples": 0, "tokens": 0}
                if cad.eval_steps and runner.step % cad.eval_steps == 0 and not last:
                    mon.log({"step": runner.step, runner.EVAL_KEY: runner.evaluate()})
                runner.after_step(last)
                if cad.save_steps and runner.step % cad.save_steps == 0 and not last:
                    checkpoint(runner, cad)
                if sleep:
                    time.sleep(sleep)
                if dist.all_reduce_sum(int(stop.requested), runner.ctx) > 0 and not last:
                    raise TrainingInterrupted(checkpoint(runner, cad), runner.step)
            eval_value = runner.evaluate()
            if eval_value is not None:
                mon.log({"step": runner.step, runner.EVAL_KEY: eval_value})
            checkpoint(runner, cad)
            final = runner.save("final", full_state=False)
    finally:
        mon.close()
    summary = _summary(runner, totals, eval_value, final)
    if main:
        mon.write(format_summary(summary))
    status.update(state="finished", step=runner.step, adapter=final, summary=summary)
    return summary


def _summary(runner: Runner, totals: Totals, eval_value: float | None, final: str) -> dict:
    ctx, elapsed = runner.ctx, time.perf_counter() - totals.started
    out = {"steps": runner.step, "epochs": round(runner.step / runner.steps_per_epoch, 3),
           "train_loss": totals.last_loss}  # fmt: skip
    if runner.EVAL_KEY is not None:
        out[runner.EVAL_KEY] = eval_value
    if totals.tokens is not None:
        rank_tok_s, tok_s = dist.throughput(totals.tokens, totals.train_time, ctx)
        out["tokens"] = dist.all_reduce_sum(totals.tokens, ctx)
    out.update(time_s=elapsed, train_time_s=totals.train_time)
    if totals.tokens is not None:
        out.update(tokens_per_s=tok_s, tokens_per_s_per_rank=rank_tok_s)
    out.update(samples_per_s=totals.examples / max(totals.train_time, 1e-9),
               peak_mem_mb=peak_memory_mb(ctx.device))  # fmt: skip
    out.update(runner.summary_fields(final, totals))
    return out


def execute(runner: Runner, status: RunStatus) -> dict:
    """Set ``runner`` up and run its loop, recording how it ended in ``status.json``: finished
    (by :func:`run_loop`), interrupted (with the checkpoint) or failed (the one-line error). A
    full disk outside a checkpoint (logs, status) is one line too; a checkpoint's own
    :class:`~lorafuse.files.DiskFullError` passes through unchanged."""
    try:
        runner.setup()
        out = runner.cadence().output_dir
        hint = functools.partial(ckpt.resume_hint, out)
        with files.disk_full_as_error("the run's output", out, then=hint):
            return run_loop(runner, status)
    except TrainingInterrupted as stop:
        status.update(state="interrupted", step=stop.step, checkpoint=stop.path)
        raise
    except BaseException as err:
        with contextlib.suppress(OSError):  # an unwritable output dir must not hide the error
            status.update(
                state="failed", error=(str(err).strip() or type(err).__name__).split("\n")[0]
            )
        raise
    finally:  # the run owns the process-wide heap policy it applied: undone when it ends
        if runner.heap_policy is not None:
            runner.heap_policy.revert()
