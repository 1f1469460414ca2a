"""Read back what a run sent to each tracker, through each tool's own reader where it has one, as
``{(figure, step): value}``, the shape :func:`jsonl_figures` gives ``logging.jsonl``.

* TensorBoard: tensorboard's ``EventAccumulator``;
* W&B: the offline run's transaction log (``run-<id>.wandb``, leveldb log format: 32 KiB blocks
  of checksummed chunks, each record a ``wandb_internal_pb2.Record``), parsed here, since the SDK
  no longer ships a Python reader; its ``history`` records are what ``wandb sync`` uploads;
* MLflow: ``MlflowClient.get_metric_history``;
* trackio: ``SQLiteStorage.get_logs``, in a child process (trackio reads ``TRACKIO_DIR`` once, at
  import).
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

BLOCK = 32768  # leveldb log block; a chunk header is 7 bytes: crc32 u32, length u16, type u8
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def jsonl_figures(path: str | os.PathLike) -> dict[tuple[str, int], float]:
    """Every number of ``logging.jsonl`` (but ``step``), keyed by (name, step)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[(k, rec["step"])] = float(v)
    return out


def tensorboard_scalars(logdir: str | os.PathLike) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def wandb_records(path: str | os.PathLike):
    """Every ``Record`` of a ``.wandb`` transaction log, in order (checksums verified)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, (ident, magic, version)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"bad checksum at {pos}"
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(run_dir: str | os.PathLike) -> dict[tuple[str, int], float]:
    """The logged figures of an offline run dir (its ``history`` records), wandb's own ``_``
    keys aside."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    out = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        step = record.history.step.num
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                out[(key, step)] = float(json.loads(item.value_json))
    return out


def mlflow_metrics(uri: str, experiment: str = "lorafuse") -> dict[tuple[str, int], float]:
    """The metrics of the one run of ``experiment`` at tracking ``uri``."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    return {(key, m.step): m.value for key in run.data.metrics
            for m in client.get_metric_history(run.info.run_id, key)}  # fmt: skip


def trackio_logs(trackio_dir: str | os.PathLike, project: str, run: str):
    """``{(figure, step): value}`` of a trackio run stored under ``trackio_dir``."""
    code = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
        "print(json.dumps(SQLiteStorage.get_logs(sys.argv[1], sys.argv[2]), default=str))"
    )
    env = dict(os.environ, TRACKIO_DIR=str(trackio_dir))
    done = subprocess.run([sys.executable, "-c", code, project, run], env=env, check=True,
                          capture_output=True, text=True)  # fmt: skip
    out = {}
    for row in json.loads(done.stdout.strip().splitlines()[-1]):
        for k, v in row.items():
            if k not in ("step", "timestamp") and isinstance(v, (int, float)):
                out[(k, row["step"])] = float(v)
    return out
