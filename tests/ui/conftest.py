"""A finished grpo run written straight into a workspace (no trainer started), shared by the
API and browser tests of how a reward-judged run is listed and summarised."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

GRPO_EVALS = {2: -0.5, 4: 0.25}  # step -> greedy held-out reward, as GRPOTrainer logs it


@pytest.fixture
def write_grpo_run():
    """``write(ws, run_id) -> records``: a finished 4-step grpo run whose records carry the keys
    ``lorafuse train --method grpo`` logs (train: ``loss``, ``reward``...; eval: ``eval_reward``)."""
    from lorafuse.ui.runs import write_json

    def write(ws: Path, run_id: str = "grpo-run") -> list[dict]:
        out = ws / "runs" / run_id / "out"
        (out / "final").mkdir(parents=True)
        records = []
        for step in range(1, 5):
            records.append({"step": step, "loss": 0.01 * step, "lr": 1e-4, "grad_norm": 0.5,
                            "tokens_per_s": 90.0, "peak_mem_mb": 300.0, "reward": 0.1 * step - 0.6,
                            "reward_std": 0.3, "frac_reward_zero_std": 0.0})  # fmt: skip
            if step in GRPO_EVALS:
                records.append({"step": step, "eval_reward": GRPO_EVALS[step]})
        (out / "logging.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        write_json(out / "status.json", {"state": "finished", "step": 4, "total_steps": 4})
        now = time.time() - 3600  # older than any run a test starts: listed last
        write_json(ws / "runs" / run_id / "run.json", {
            "id": run_id, "name": "grpo dates", "status": "finished", "created": now,
            "queued_at": None, "started": now, "ended": now + 60, "pid": None,
            "pid_started": None, "exit_code": 0, "message": None, "action": "train",
            "stop_requested_at": None, "total_steps": 4,
        })  # fmt: skip
        return records

    return write
