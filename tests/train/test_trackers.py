"""``report_to``: TensorBoard, W&B (offline), MLflow (local store) and trackio (local) each hold the
figures of ``logging.jsonl``, read back through each tool's own reader."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from lorafuse.testing import trackers as read
from lorafuse.train.config import ConfigError, TrainConfig


def same_figures(got: dict, want: dict, rel: float = 0.0) -> None:
    assert set(got) == set(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))
    for key, value in want.items():
        assert abs(got[key] - value) <= rel * abs(value), (key, got[key], value)


@pytest.mark.slow
def test_every_tracker_holds_the_logged_figures(tiny_model_dir, chat_file, tmp_path):
    for lib in ("tensorboard", "wandb", "mlflow", "trackio"):
        pytest.importorskip(lib)
    out, trackio_dir = tmp_path / "run", tmp_path / "trackio"
    env = dict(os.environ, WANDB_MODE="offline", TRACKIO_DIR=str(trackio_dir), HF_HUB_OFFLINE="1")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME",
                 "TRACKIO_PROJECT"):  # fmt: skip
        env.pop(name, None)
    cmd = [sys.executable, "-m", "lorafuse", "train", "--model", tiny_model_dir, "--data",
           chat_file, "--output-dir", str(out), "--max-steps", "3", "--eval-steps", "2",
           "--eval-split", "0.1", "--max-seq-length", "64", "--no-progress", "--dtype", "float32",
           "--device", "cpu", "--no-gradient-checkpointing", "--save-steps", "0",
           "--report-to", "tensorboard,wandb", "mlflow", "trackio"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    json.loads(done.stdout.strip().splitlines()[-1])  # trackio's prints stay off stdout
    want = read.jsonl_figures(out / "logging.jsonl")
    assert ("eval_loss", 2) in want and ("loss", 3) in want and ("tokens_per_s", 1) in want
    same_figures(read.tensorboard_scalars(out / "tensorboard"), want, rel=1e-6)  # float32 events
    (run_dir,) = glob.glob(str(out / "wandb" / "offline-run-*"))
    same_figures(read.wandb_history(run_dir), want)
    same_figures(read.mlflow_metrics(f"sqlite:///{out / 'mlflow.db'}"), want)
    same_figures(read.trackio_logs(trackio_dir, "lorafuse", "run"), want)


def test_mlflow_file_store_when_asked(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from lorafuse.train.trackers import Trackers

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "files")
    trackers = Trackers(["mlflow"], str(tmp_path / "out"), {"lr": 1e-3, "data": ["a.jsonl"]})
    records = [{"step": 1, "loss": 2.5, "lr": 1e-3, "note": "x"}, {"step": 2, "eval_loss": 2.25}]
    for r in records:
        trackers.log(r)
    trackers.close()
    assert read.mlflow_metrics(uri, "files") == {("loss", 1): 2.5, ("lr", 1): 1e-3,
                                                 ("eval_loss", 2): 2.25}  # fmt: skip


def test_report_to_settings():
    cfg = TrainConfig(report_to=["tensorboard,wandb", "mlflow", "wandb"])
    assert cfg.report_to == ["tensorboard", "wandb", "mlflow"]
    assert TrainConfig(tensorboard=True, report_to=["trackio"]).trackers() == [
        "trackio",
        "tensorboard",
    ]
    with pytest.raises(ConfigError, match="report_to.*tensorboard | wandb | mlflow | trackio"):
        TrainConfig(report_to=["neptune"])
