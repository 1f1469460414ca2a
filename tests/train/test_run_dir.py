"""The run directory (lorafuse.train.run_dir): a new run never lands on an old one (refused, or
moved aside with --overwrite), one writer at a time (a real second process holds the lock), a
lock left by a killed process is taken over, and the lock goes however the run ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lorafuse.commands import main
from lorafuse.testing import one_error_line
from lorafuse.train import run_dir
from lorafuse.train.engine import train


def _argv(tiny_model_dir, chat_file, out, *extra) -> list[str]:
    return ["train", "--model", tiny_model_dir, "--data", chat_file, "--output-dir", str(out),
            "--max-seq-length", "64", "--no-gradient-checkpointing", "--no-progress",
            "--dtype", "float32", "--device", "cpu", "--max-steps", "2", "--save-steps", "1",
            "--num-threads", "1", *extra]  # fmt: skip


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_second_run_is_refused_and_overwrite_moves_the_first_aside(
    tiny_model_dir, chat_file, tmp_path, capsys
):
    out = tmp_path / "out"
    argv = _argv(tiny_model_dir, chat_file, out)
    assert main(argv) == 0
    first = _snapshot(out)
    capsys.readouterr()
    assert main(argv) == 2
    assert one_error_line(capsys) == (
        f"lorafuse train: error: {out} already holds a finished run (step 2 of 2; checkpoint-1, "
        f"checkpoint-2, final/, logging.jsonl, status.json); continue it with --resume {out}, or "
        f"start a new run there with --overwrite (moves the old run's files to {out}.old-<time>, "
        "deletes nothing)"
    )
    assert _snapshot(out) == first  # untouched, and no lock left behind
    (out / "notes.txt").write_text("mine")  # not the run's: stays where it is
    assert main([*argv, "--overwrite"]) == 0
    err = capsys.readouterr().err
    aside = sorted(tmp_path.glob("out.old-*"))
    assert len(aside) == 1 and _snapshot(aside[0]) == first  # the whole first run, moved
    assert "lorafuse: --overwrite: moved a finished run (step 2 of 2; " in err
    assert f"to {aside[0]}" in err
    assert (out / "notes.txt").read_text() == "mine"
    logged = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2]  # the new run's steps only


def test_python_callers_get_the_same_protection(make_config, tmp_path):
    out = str(tmp_path / "out")
    train(make_config(output_dir=out, max_steps=1, num_threads=1))
    with pytest.raises(run_dir.RunDirError, match="already holds a finished run"):
        train(make_config(output_dir=out, max_steps=1))
    with pytest.raises(run_dir.RunDirError, match="--overwrite starts a new run and --resume"):
        train(make_config(output_dir=out, max_steps=1, overwrite=True, resume=out))


HOLDER = """
import sys, time
from lorafuse.train import run_dir
with run_dir.claim(sys.argv[1]):
    print("held", flush=True)
    time.sleep(300)
"""


def _hold(out: Path, env: dict | None = None) -> subprocess.Popen:
    """A real second process holding ``out`` (what a running trainer does) until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE,
                            env=env)  # fmt: skip
    assert proc.stdout.readline().strip() == b"held"
    return proc


def test_a_second_writer_is_refused_and_a_killed_holder_is_stale(
    tiny_model_dir, chat_file, tmp_path, capsys
):
    out = tmp_path / "out"
    argv = _argv(tiny_model_dir, chat_file, out)
    holder = _hold(out)
    try:
        assert main(argv) == 2
        line = one_error_line(capsys)
        assert line.startswith(
            f"lorafuse train: error: {out} is in use by another run: pid {holder.pid} on "
            f"{socket.gethostname()}, started "
        )
        assert line.endswith(f"; lock file {out}/run.lock); wait for it to end or stop it, or use "
                             "another --output-dir")  # fmt: skip
        assert os.listdir(out) == ["run.lock"]  # the refused run wrote nothing
    finally:
        holder.kill()  # SIGKILL: no cleanup; the kernel drops the flock, the record stays
        holder.wait()
    assert json.loads((out / "run.lock").read_text())["pid"] == holder.pid
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"lorafuse: warning: taking over a stale lock: pid {holder.pid} on " in err
    assert "is gone" in err
    assert not (out / "run.lock").exists()  # released at the end


@pytest.mark.parametrize("ending", ["non-finite loss", "Ctrl-C", "second Ctrl-C", "error"])
def test_the_lock_is_released_however_the_run_ends(make_config, tmp_path, monkeypatch, ending):
    from lorafuse.train.engine import Trainer
    from lorafuse.train.loop import TrainingError, TrainingInterrupted

    raised = {"non-finite loss": TrainingError, "Ctrl-C": TrainingInterrupted,
              "second Ctrl-C": KeyboardInterrupt, "error": RuntimeError}[ending]  # fmt: skip
    real = Trainer.train_step

    def step(self):
        assert (Path(self.cfg.output_dir) / "run.lock").is_file()  # held while it runs
        if self.step == 1:
            if ending == "non-finite loss":
                self.check_finite("loss", float("nan"))
            elif ending == "Ctrl-C":  # handled: a checkpoint after this step, then a stop
                os.kill(os.getpid(), signal.SIGINT)
            elif ending == "second Ctrl-C":
                raise KeyboardInterrupt
            else:
                raise RuntimeError("boom")
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    out = tmp_path / "out"
    with pytest.raises(raised):
        train(make_config(output_dir=str(out), max_steps=4, num_threads=1))
    assert not (out / "run.lock").exists()
    said = []
    with run_dir.claim(out, resume=str(out), say=said.append):  # free, and not stale
        pass
    assert said == []


def test_nproc_launcher_refuses_before_any_rank_starts(
    tiny_model_dir, chat_file, tmp_path, monkeypatch, capsys
):
    from lorafuse.train import launcher

    out = tmp_path / "out"
    argv = _argv(tiny_model_dir, chat_file, out)
    assert main(argv) == 0
    monkeypatch.setattr(launcher, "launch_torchrun", lambda *a, **k: pytest.fail("launched"))
    capsys.readouterr()
    assert main([*argv, "--nproc", "2"]) == 2
    assert "already holds a finished run" in one_error_line(capsys)


def test_nproc_ranks_run_under_their_launchers_lock(
    tiny_model_dir, chat_file, tmp_path, monkeypatch
):
    """The launcher holds the lock while torchrun runs; rank 0 (a real process with the launcher's
    environment) goes on under it, any other process is refused."""
    from lorafuse.train import launcher

    out = tmp_path / "out"
    seen = {}

    def fake_launch(nproc, argv, env=None):
        record = json.loads((out / "run.lock").read_text())
        seen["holder"] = record["pid"]
        rank0 = _hold(out, env)  # claims under the launcher's lock
        rank0.kill()
        rank0.wait()
        outsider = subprocess.run([sys.executable, "-c", HOLDER, str(out)], capture_output=True,
                                  text=True, timeout=60)  # fmt: skip
        seen["outsider"] = outsider.stderr.strip().splitlines()[-1]
        return 0

    monkeypatch.setattr(launcher, "launch_torchrun", fake_launch)
    assert main([*_argv(tiny_model_dir, chat_file, out), "--nproc", "2"]) == 0
    assert seen["holder"] == os.getpid()
    assert f"is in use by another run: pid {os.getpid()} on " in seen["outsider"]
    assert not (out / "run.lock").exists()  # the launcher released it; rank 0 never took it


def test_a_run_that_failed_before_its_first_step_leaves_nothing_to_refuse(
    tiny_model_dir, chat_file, tmp_path, capsys
):
    """Bad data stops the run in setup: only status.json (failed, step 0) is left; the rerun with
    the data fixed goes ahead there."""
    out = tmp_path / "out"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 5}\n')
    assert main(_argv(tiny_model_dir, str(bad), out)) == 2
    assert os.listdir(out) == ["status.json"] and run_dir.run_markers(out) == []
    assert main(_argv(tiny_model_dir, chat_file, out)) == 0
    assert "already holds" not in capsys.readouterr().err


def test_without_flock_the_record_still_guards(tmp_path, monkeypatch):
    """A file system that cannot flock (ENOLCK): said, and the holder's record decides: a live
    process named in it keeps the directory, a dead one's record is stale."""
    import errno

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    out = tmp_path / "out"
    holder = _hold(out)  # a real process that did lock it (its file system view is the same)
    monkeypatch.setattr(run_dir.fcntl, "flock", no_locks)
    said = []
    try:
        with pytest.raises(run_dir.RunLocked, match=f"in use by another run: pid {holder.pid} "):
            with run_dir.claim(out, say=said.append):
                pass
        assert said == [f"warning: {out} cannot be flock-ed (No locks available): the lock is its "
                        "record only (a live process named in it on this host keeps it)"]  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    with run_dir.claim(out, say=said.append):
        assert json.loads((out / "run.lock").read_text())["pid"] == os.getpid()
    assert f"taking over a stale lock: pid {holder.pid} on" in said[-1]


def test_an_output_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(run_dir.RunDirError, match=r"cannot use .*file/out as the output directory"):
        with run_dir.claim(tmp_path / "file" / "out"):
            pass
