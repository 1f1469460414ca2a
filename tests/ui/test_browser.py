"""The page of ``lorafuse ui`` in a real browser (Debian's chromium driven by Playwright).

One scenario against the real server and a tiny CPU model: fill the form (picking the data file
through the workspace file picker), start, see chart points arrive, reload and find the same run
and points, stop (checkpoint), resume from that step, then chat with the base model and the
adapter side by side. Screenshots go to ``tmp_path`` and, with ``$LORAFUSE_UI_SCREENSHOTS=<dir>``,
there too (``docs/images`` takes the docs' pictures from this test).

``.ci/run`` installs chromium; without it this test fails with a message saying so, unless
``$LORAFUSE_SKIP_BROWSER=1`` (then it skips). Never ``playwright install``: it downloads a browser.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lorafuse.testing import save_tiny_model

pytestmark = pytest.mark.slow

STEP_SLEEP = "0.25"  # LORAFUSE_DEBUG_STEP_SLEEP for the trainer: leaves time to press Stop
MAX_STEPS = 16


def chromium_path() -> str:
    if os.environ.get("LORAFUSE_SKIP_BROWSER") == "1":
        pytest.skip("LORAFUSE_SKIP_BROWSER=1")
    path = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if path is None:
        pytest.fail(
            "the browser test needs Debian's chromium (`apt-get install chromium`; .ci/run does it); "
            "set LORAFUSE_SKIP_BROWSER=1 to skip it"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def make_workspace(ws: Path) -> None:
    """A tiny chat model and 40 short chats: each optimizer step takes milliseconds on one core."""
    save_tiny_model(ws / "model")
    with open(ws / "chat.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            q = f"what is {i} and {i + 1}"
            a = f"the answer is {2 * i + 1}" + " indeed" * (i % 5)
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": msgs}) + "\n")


def write_grpo_run(ws: Path, run_id: str = "grpo-run") -> None:
    """A finished 4-step grpo run, as ``lorafuse train --method grpo`` logs it (train records with
    ``reward``; eval records with ``eval_reward``: -0.5 at step 2, 0.25 at step 4)."""
    from lorafuse.ui.processes import write_json

    out = ws / "runs" / run_id / "out"
    (out / "final").mkdir(parents=True)
    records = []
    for step in range(1, 5):
        records.append({"step": step, "loss": 0.01 * step, "lr": 1e-4, "grad_norm": 0.5,
                        "tokens_per_s": 90.0, "peak_mem_mb": 300.0, "reward": 0.1 * step - 0.6,
                        "reward_std": 0.3})  # fmt: skip
        if step % 2 == 0:
            records.append({"step": step, "eval_reward": {2: -0.5, 4: 0.25}[step]})
    (out / "logging.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_json(out / "status.json", {"state": "finished", "step": 4, "total_steps": 4})
    then = time.time() - 3600  # older than the run the scenario starts: listed after it
    write_json(ws / "runs" / run_id / "run.json", {
        "id": run_id, "name": "grpo dates", "status": "finished", "created": then,
        "queued_at": None, "started": then, "ended": then + 60, "pid": None, "pid_started": None,
        "exit_code": 0, "message": None, "action": "train", "stop_requested_at": None,
        "total_steps": 4,
    })  # fmt: skip


@pytest.fixture
def server(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    make_workspace(ws)
    write_grpo_run(ws)  # a finished grpo run, found by the server's startup scan
    port = free_port()
    env = dict(os.environ, LORAFUSE_DEBUG_STEP_SLEEP=STEP_SLEEP)
    log = open(tmp_path / "server.log", "wb")
    cmd = [sys.executable, "-m", "lorafuse", "ui", "--port", str(port), "--workspace", str(ws)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 30
    while True:
        try:
            get_json(url + "api/info")
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail(
                    "`lorafuse ui` did not start:\n" + (tmp_path / "server.log").read_text()
                )
            time.sleep(0.2)
    try:
        yield url, ws
    finally:
        try:  # a failed test must not leave a detached trainer behind
            for run in get_json(url + "api/runs")["runs"]:
                if run["status"] in ("running", "stopping") and run["pid"]:
                    os.killpg(run["pid"], signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def shot(page, tmp_path: Path, name: str, t0: float) -> None:
    print(f"{time.monotonic() - t0:6.1f} s  {name}", flush=True)  # where the time goes (-s)
    dirs = [tmp_path / "screenshots"]
    if os.environ.get("LORAFUSE_UI_SCREENSHOTS"):
        dirs.append(Path(os.environ["LORAFUSE_UI_SCREENSHOTS"]))
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(d / f"ui-{name}.png"))


def loss_points(page) -> int:
    return int(page.get_attribute("#run-charts canvas", "data-points") or 0)


def wait_points(page, at_least: int, timeout_ms: int = 90000) -> None:
    page.wait_for_function(
        "n => +(document.querySelector('#run-charts canvas')?.dataset.points || 0) >= n",
        arg=at_least, timeout=timeout_ms,
    )  # fmt: skip


def wait_status(page, statuses: tuple[str, ...], timeout_ms: int = 90000) -> str:
    page.wait_for_function(
        "s => s.includes(document.querySelector('#run-status')?.textContent)",
        arg=list(statuses), timeout=timeout_ms,
    )  # fmt: skip
    return page.text_content("#run-status")


@pytest.fixture
def chromium() -> str:
    """Checked before the server starts, so a skip or a missing browser costs nothing."""
    return chromium_path()


def test_train_watch_reload_stop_resume_chat(chromium, server, tmp_path):
    exe = chromium
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser test needs python playwright: pip install -e '.[dev]'")

    url, ws = server
    t0 = time.monotonic()
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            # generous: a loaded CI machine starts a trainer or a model server in tens of seconds
            page.set_default_timeout(60000)
            page.goto(url)

            # ---- A finished grpo run is judged by its reward: list entry, summary, chart ----
            item = page.wait_for_selector(".run-item[data-id=grpo-run]")
            assert "eval reward 0.250" in item.text_content()  # step 4's eval, not loss
            item.click()
            page.wait_for_selector("[data-k='eval reward']:has-text('0.25')")
            reward_chart = page.locator("#run-charts canvas").nth(5)
            page.wait_for_function(
                "c => c.dataset.points === '6'", arg=reward_chart.element_handle()
            )  # 4 train + 2 eval points
            page.click("#tab-new")

            # ---- New run: the form comes from the schema; the data file from the picker ----
            page.fill("#run-name", "tiny-chat")
            page.fill("#f-model", str(ws / "model"))
            page.click("#view-new [data-field=data] button")
            page.click("#file-list button:has-text('chat.jsonl')")
            assert page.input_value("#f-data") == "chat.jsonl"
            page.click("details[data-group=run] > summary")  # the "Run" settings start folded
            settings = dict(max_steps=MAX_STEPS, save_steps=4, max_seq_length=64, num_threads=1,
                            device="cpu", lr=0.01, eval_split=0.2, eval_steps=4)  # fmt: skip
            for name, value in settings.items():
                page.fill(f"#f-{name}", str(value))
            page.select_option("#f-dtype", "float32")
            page.uncheck("#f-gradient_checkpointing")
            # a bad value gets its message next to its field, from TrainConfig itself
            page.fill("#f-lora_r", "0")
            page.wait_for_selector("#err-lora_r:has-text('lora_r')")
            page.fill("#f-lora_r", "8")
            page.wait_for_function("!document.querySelector('#err-lora_r').textContent")
            page.wait_for_selector("#preview .metric-value")  # dataset preview: 40 records
            assert "40" in page.text_content("#preview")
            page.wait_for_selector("#estimate .metric-value")
            assert "lorafuse train" in page.text_content("#cli-preview")
            page.evaluate("document.querySelector('main').scrollTo(0, 0)")
            shot(page, tmp_path, "new", t0)

            page.click("#start-btn")
            page.wait_for_url(re.compile(r"#/run/.+"))
            run_url = page.url
            wait_status(page, ("running",))
            wait_points(page, 3)

            # ---- Reload: the same run and its points come back from the server ----
            seen = loss_points(page)
            page.reload()
            assert page.url == run_url
            page.wait_for_selector("#run-name-h:has-text('tiny-chat')")
            wait_points(page, seen)
            shot(page, tmp_path, "reload", t0)

            # ---- Stop: SIGTERM -> checkpoint; Resume shows the step it continues from ----
            page.click("#stop-btn")
            assert wait_status(page, ("stopped",)) == "stopped"
            page.wait_for_selector("#resume-btn:visible")
            resume_from = int(re.search(r"step (\d+)", page.text_content("#resume-btn")).group(1))
            assert 1 <= resume_from < MAX_STEPS
            stopped_points = loss_points(page)
            page.click("#resume-btn")
            wait_points(page, stopped_points + 1)
            assert wait_status(page, ("finished",)) == "finished"
            wait_points(page, MAX_STEPS)
            assert page.text_content("[data-k=step]").startswith(f"{MAX_STEPS} / {MAX_STEPS}")
            shot(page, tmp_path, "run", t0)

            # ---- Compare: the run's curves overlaid (from /metrics, no process started) ----
            page.click("#tab-compare")
            page.check("#compare-picks input")
            page.wait_for_function(
                "n => +(document.querySelector('#compare-charts canvas')?.dataset.points || 0) >= n",
                arg=MAX_STEPS,
            )  # fmt: skip
            page.click("#tab-run")

            # ---- Chat: the base model and the adapter side by side, streamed ----
            page.click("#chat-run-btn")
            page.wait_for_selector("#view-chat:visible")
            page.fill("#chat-max", "12")
            page.fill("#chat-text", "what is 1 and 2")
            page.press("#chat-text", "Enter")
            for pane in ("#chat-a-msgs", "#chat-b-msgs"):
                reply = page.wait_for_selector(
                    f"{pane} .msg[data-role=assistant]:not(.streaming)", timeout=90000
                )
                assert "error" not in (reply.get_attribute("class") or ""), reply.text_content()
                assert reply.query_selector(".msg-text").text_content().strip()
            shot(page, tmp_path, "chat", t0)
        finally:
            browser.close()
    assert not errors, errors
