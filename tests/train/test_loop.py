"""The loop shell (``lorafuse.train.loop``) on a fake runner with no model: logging, eval and
checkpoint cadence, rotation, the summary, status.json for every way a run ends, a stop signal,
and the one-line errors; and that both real trainers run in this shell, not a copy of it."""

from __future__ import annotations

import inspect
import json
import os
import signal

import pytest

from lorafuse.train import checkpoint as ckpt
from lorafuse.train import distributed as dist
from lorafuse.train import loop
from lorafuse.train import status as run_status


class Fake(loop.Runner):
    """Steps whose loss is 1/step; a checkpoint is a directory (with an empty state file)."""

    def __init__(self, out, total=5, logging=2, eval_every=2, save=2, limit=2, **hooks):
        self.out, self.total_steps, self.hooks = str(out), total, hooks
        self.cad = loop.Cadence(self.out, logging, save, limit, eval_every, progress=False)
        self.ctx = dist.setup("none", device="cpu")
        self.step, self.steps_per_epoch, self.saved, self.evals = 0, 4, [], []

    def setup(self):
        pass

    def cadence(self):
        return self.cad

    def train_step(self):
        if "before" in self.hooks:
            self.hooks["before"](self)
        loss = 1.0 / (self.step + 1)
        self.check_finite("loss", self.hooks.get("loss", lambda s, v: v)(self, loss))
        self.step += 1  # as a real step: checked before the update
        return {"loss": loss, "lr": 0.1, "grad_norm": 1.0, "examples": 3, "tokens": 10}

    def evaluate(self):
        self.evals.append(self.step)
        return 0.5

    def save(self, name, full_state):
        path = os.path.join(self.out, name)
        os.makedirs(path)
        if full_state:  # what makes a checkpoint complete (and rotatable)
            open(os.path.join(path, ckpt.STATE_NAME), "w").close()
        self.saved.append((name, full_state))
        return path

    def out_of_memory(self, err):
        return f"out of memory at step {self.step + 1}: lower it"

    def summary_fields(self, final, totals):
        return {"final": final, "mean": totals.loss_sum / totals.steps_run}


def _dirs(out):
    return sorted(d for d in os.listdir(out) if d.startswith(("checkpoint", "final")))


def test_cadence_rotation_summary_and_status(tmp_path):
    r = Fake(tmp_path / "out")
    summary = loop.execute(r, run_status.RunStatus(r.out))
    logged = [json.loads(x) for x in open(os.path.join(r.out, "logging.jsonl"))]
    assert [x["step"] for x in logged if "loss" in x] == [2, 4, 5]  # every 2nd and the last
    assert [x["step"] for x in logged if "eval_loss" in x] == [2, 4, 5]  # every 2nd and the end
    assert r.evals == [2, 4, 5]
    first = logged[0]
    assert first["tokens_per_s"] > 0 and first["samples_per_s"] > 0 and first["loss"] == 0.5
    assert r.saved == [("checkpoint-2", True), ("checkpoint-4", True), ("checkpoint-5", True),
                       ("final", False)]  # fmt: skip
    assert _dirs(r.out) == ["checkpoint-4", "checkpoint-5", "final"]  # save_total_limit=2
    assert r.last_checkpoint == os.path.join(r.out, "checkpoint-5")
    assert summary["steps"] == 5 and summary["train_loss"] == 0.2 and summary["eval_loss"] == 0.5
    assert summary["tokens"] == 50 and summary["final"] == os.path.join(r.out, "final")
    assert summary["mean"] == pytest.approx(sum(1 / s for s in range(1, 6)) / 5, rel=1e-12)
    assert list(summary)[:5] == ["steps", "epochs", "train_loss", "eval_loss", "tokens"]
    st = run_status.read(r.out)
    assert st["state"] == "finished" and st["step"] == 5 and st["total_steps"] == 5
    assert st["summary"]["steps"] == 5 and st["adapter"] == summary["final"]


def test_a_runner_without_tokens_or_eval_has_neither_in_its_summary(tmp_path):
    class NoTokens(Fake):
        EVAL_KEY = None

        def train_step(self):
            fig = super().train_step()
            del fig["tokens"]
            return fig

        def evaluate(self):
            return None

    r = NoTokens(tmp_path / "out", eval_every=0)
    summary = loop.run_loop(r)
    assert not {"tokens", "tokens_per_s", "eval_loss", None} & set(summary)
    logged = [json.loads(x) for x in open(os.path.join(r.out, "logging.jsonl"))]
    assert all("tokens_per_s" not in x for x in logged)


def test_sigterm_saves_a_checkpoint_and_records_interrupted(tmp_path):
    def kill_at_3(r):
        if r.step == 2:  # during step 3
            os.kill(os.getpid(), signal.SIGTERM)

    r = Fake(tmp_path / "out", total=10, save=0, before=kill_at_3)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(loop.TrainingInterrupted, match="interrupted at step 3") as stop:
        loop.execute(r, run_status.RunStatus(r.out))
    assert stop.value.path == os.path.join(r.out, "checkpoint-3")
    assert _dirs(r.out) == ["checkpoint-3"]
    assert signal.getsignal(signal.SIGTERM) is before  # the shell's handler is gone again
    st = run_status.read(r.out)
    assert st["state"] == "interrupted" and st["step"] == 3
    assert st["checkpoint"] == stop.value.path


@pytest.mark.parametrize("fault", ["nan", "oom"])
def test_faults_are_one_line_naming_the_last_checkpoint(tmp_path, fault):
    def at_step_4(r, value):
        return float("nan") if r.step == 3 else value

    def oom_at_4(r):
        if r.step == 3:
            raise MemoryError("cannot allocate")

    hooks = {"loss": at_step_4} if fault == "nan" else {"before": oom_at_4}
    r = Fake(tmp_path / "out", total=6, save=1, limit=0, **hooks)
    with pytest.raises(loop.TrainingError) as err:
        loop.execute(r, run_status.RunStatus(r.out))
    line = str(err.value)
    want = "non-finite loss (nan) at step 4" if fault == "nan" else "out of memory at step 4"
    assert line.startswith(want) and "\n" not in line
    assert f"Last good checkpoint: {os.path.join(r.out, 'checkpoint-3')}" in line
    assert "final" not in _dirs(r.out)
    st = run_status.read(r.out)
    assert st["state"] == "failed" and st["error"] == line


def test_both_trainers_run_in_the_shared_shell():
    """The engine (and GRPO through it) and the image trainer inherit the shell's ``run``; none
    of them keeps its own signal handling, summary table or checkpoint rotation."""
    from lorafuse.image import trainer as image_trainer
    from lorafuse.train import engine, grpo_trainer

    trainers = (engine.Trainer, grpo_trainer.GRPOTrainer, image_trainer.ImageTrainer)
    for cls in trainers:
        assert issubclass(cls, loop.Runner) and cls.run is loop.Runner.run, cls
    for module in (engine, grpo_trainer, image_trainer):
        source = inspect.getsource(module)
        for own_copy in ("import signal", "format_summary", "ckpt.rotate", "Monitor("):
            assert own_copy not in source, (module.__name__, own_copy)
