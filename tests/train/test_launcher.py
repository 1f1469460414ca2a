"""lorafuse.train.launcher (``lorafuse train --nproc N``): the torchrun command, exit codes, and
signals: SIGTERM reaches torchrun, and no process started under it outlives the launcher."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafuse.errors import LorafuseError
from lorafuse.train import launcher as L

HERE = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def world1_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)


def test_torchrun_command_and_strip_nproc():
    cmd = L.torchrun_command(2, ["--data", "x.jsonl", "--nproc", "2", "--steps=3", "--nproc=4"])
    assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "2"]  # fmt: skip
    assert cmd[6:] == ["-m", "lorafuse", "train", "--data", "x.jsonl", "--steps=3"]
    assert L.torchrun_command(3, ["train", "--steps", "1"])[6:] == [
        "-m", "lorafuse", "train", "--steps", "1"]  # fmt: skip
    with pytest.raises(LorafuseError, match="--nproc must be >= 1"):
        L.torchrun_command(0, [])


def test_launch_torchrun_refuses_inside_a_worker(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    with pytest.raises(LorafuseError, match="inside a torchrun worker"):
        L.launch_torchrun(2, ["--steps", "1"])


def test_launch_torchrun_returns_the_job_exit_code(monkeypatch, capfd):
    world1_env(monkeypatch)
    script = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              "2", str(HERE / "dist_dies.py"), "--mode", "exit"]  # fmt: skip
    seen = {}

    def fake_command(nproc, argv):
        seen["args"] = (nproc, argv)
        return script

    monkeypatch.setattr(L, "torchrun_command", fake_command)
    code = L.launch_torchrun(2, ["--mode", "exit"])
    assert seen["args"] == (2, ["--mode", "exit"])
    assert code == 1  # torchrun's exit status when a worker failed
    assert "distributed job failed (exit 1)" in capfd.readouterr().err


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def sigterm_launcher(tmp_path: Path, cmd: list[str], timeout: float, *setup: str):
    """Run ``launch_torchrun`` (torchrun command ``cmd``) in a child, SIGTERM it once torchrun runs
    2 processes; returns (exit code, output) once the output pipe reaches EOF.

    EOF needs every process that inherited the pipe gone, torchrun's workers included, so a
    worker outliving the launcher fails this as a timeout that names who is still alive."""

    driver = tmp_path / "driver.py"
    driver.write_text("\n".join(["import sys", "from lorafuse.train import launcher as L", *setup,
                                  f"L.torchrun_command = lambda n, a: {cmd!r}",
                                  "sys.exit(L.launch_torchrun(2, []))", ""]))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("LORAFUSE_DIST_TIMEOUT", None)
    proc = subprocess.Popen([sys.executable, str(driver)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 60  # wait until torchrun (driver's child) runs its 2 workers
    seen: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None:
        seen = [proc.pid, *children(proc.pid)]
        seen += [w for c in seen[1:] for w in children(c)]
        if len(seen) >= 4:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        alive = [p for p in seen if Path(f"/proc/{p}").exists()]  # zombies too: not yet reaped
        for p in reversed(alive):  # workers first; they would outlive the test otherwise
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        raise AssertionError(f"launcher still running {timeout:.0f} s after SIGTERM; alive "
                             f"{alive} of launcher, torchrun, workers {seen}") from None  # fmt: skip
    return proc.returncode, out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_launch_torchrun_forwards_sigterm(tmp_path):
    """SIGTERM to the launcher reaches torchrun, which stops its (hung) workers: a quick non-zero
    exit instead of waiting for the 600 s collective timeout."""
    cmd = [*TORCHRUN, "--nproc-per-node", "2", str(HERE / "dist_dies.py"), "--mode", "hang"]
    code, out = sigterm_launcher(tmp_path, cmd, 60)
    assert code != 0, out[-2000:]
    assert "distributed job failed" in out
    # torchrun stopped by itself, so the signal reached it: without forwarding, the launcher's
    # GRACE_S (40 s) escalation would end the job inside the 60 s and hide the bug
    assert "killing it and its workers" not in out, out[-2000:]


# A torchrun stand-in with 2 workers in their own sessions (as torchrun starts them) that would
# hold the launcher's stdout for 60 s.  "ignore": torchrun stuck in shutdown; "abandon": torchrun
# exits without stopping its workers (what it does when SIGTERM lands while it starts workers).
FAKE_TORCHRUN = """import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1] == "ignore" else lambda *a: os._exit(1))
for _ in range(2):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(("mode", "want"), [("ignore", 128 + 15), ("abandon", 1)])
def test_launch_torchrun_leaves_no_process_behind(tmp_path, mode, want):
    """A stuck torchrun is killed GRACE_S (1 s here) after the forwarded SIGTERM; a worker torchrun
    left running is killed once torchrun is gone.  10 s: two bare Pythons start well within it."""
    (tmp_path / "fake_torchrun.py").write_text(FAKE_TORCHRUN)
    cmd = [sys.executable, str(tmp_path / "fake_torchrun.py"), mode]
    code, out = sigterm_launcher(tmp_path, cmd, 10, "L.GRACE_S = 1.0")
    assert code == want, out[-2000:]
    assert f"distributed job failed (exit {want})" in out
    assert ("still running 1 s after SIGTERM" in out) == (mode == "ignore")
