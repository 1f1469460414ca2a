"""The live view of a run: progress bar, ``logging.jsonl``, trackers (``report_to``), final summary.

Only the main rank creates a :class:`Monitor` that writes anything; other ranks get ``enabled=False``.
Every log step appends one JSON object per line to ``<output_dir>/logging.jsonl`` (flushed, so a
killed run keeps its history) with the figures the bar shows: loss, lr, grad_norm, tokens/s,
samples/s, peak memory, elapsed and ETA; each tracker (:mod:`lorafuse.train.trackers`: TensorBoard,
W&B, MLflow, trackio) gets the same numbers at the same step.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

from lorafuse.train.trackers import Trackers


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory, or the process's peak resident set size on CPU, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Monitor:
    def __init__(self, output_dir: str, total_steps: int, start_step: int, *, enabled: bool,
                 progress: bool = True, report_to: tuple[str, ...] = (),
                 config: dict | None = None) -> None:  # fmt: skip
        self.enabled = enabled
        self.total = total_steps
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self.history: list[dict] = []
        self.bar = None
        self.trackers = None
        self.path = os.path.join(output_dir, "logging.jsonl")
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if report_to:
            self.trackers = Trackers(list(report_to), output_dir, config)
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)  # fmt: skip

    def log(self, record: dict) -> None:
        """Append one log record (must have ``step``); update the bar and the trackers."""
        if not self.enabled:
            return
        self.history.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)
        if self.bar is not None and "loss" in record:
            post = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}"}
            if "tokens_per_s" in record:  # image training has no tokens
                post["tok_s"] = f"{record['tokens_per_s']:.0f}"
            post["samp_s"] = f"{record['samples_per_s']:.1f}"
            post["mem"] = f"{record['peak_mem_mb']:.0f}MiB"
            self.bar.set_postfix(post, refresh=False)

    def step_done(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def write(self, msg: str) -> None:
        """A message that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def format_summary(summary: dict) -> str:
    """A small aligned table of the final figures."""
    width = max(len(k) for k in summary)
    lines = ["training summary"]
    for k, v in summary.items():
        v = f"{v:.4g}" if isinstance(v, float) else v
        lines.append(f"  {k:<{width}}  {v}")
    return "\n".join(lines)
