"""Experiment trackers: the figures of ``logging.jsonl``, also sent to TensorBoard, Weights & Biases,
MLflow or trackio (``report_to``), each through its own library.

Every log record's numbers (all but ``step``) go to each tracker at the record's ``step``, so a
tracker holds the same figures as ``logging.jsonl``; the resolved config goes along as the run's
parameters. Where a run goes follows each tool's own settings, with local defaults:

* ``tensorboard``: event files in ``<output_dir>/tensorboard``;
* ``wandb``: ``wandb.init`` (``WANDB_MODE=offline`` for no network; ``WANDB_PROJECT``, default
  ``lorafuse``); run files in ``<output_dir>/wandb`` unless ``WANDB_DIR`` says otherwise;
* ``mlflow``: ``MLFLOW_TRACKING_URI``, else a local SQLite store ``<output_dir>/mlflow.db``
  (MLflow 3's local default: its file store ``./mlruns`` is in maintenance mode and refuses runs
  unless ``MLFLOW_ALLOW_FILE_STORE=true``; set both to use it); experiment
  ``MLFLOW_EXPERIMENT_NAME`` (default ``lorafuse``), through ``MlflowClient`` (no process-wide
  active run);
* ``trackio``: ``trackio.init`` (local SQLite under ``TRACKIO_DIR``, default
  ``$HF_HOME/trackio``); project ``TRACKIO_PROJECT`` (default ``lorafuse``).

The run is named after the output directory. A tracker whose library is missing is one line naming
the extra to install, raised before training starts.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time

from lorafuse.errors import LorafuseError

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
# the import that must work, and the extra that installs it
LIBRARIES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
             "trackio": "trackio"}  # fmt: skip
PROJECT = "lorafuse"


class TrackerError(LorafuseError, RuntimeError):
    """A tracker cannot be used (its library is missing or refuses the run)."""


def require(name: str):
    """The tracker's library, or :class:`TrackerError` naming the extra that installs it."""
    try:
        return importlib.import_module(LIBRARIES[name])
    except ImportError as err:
        raise TrackerError(
            f"report_to={name} needs the {LIBRARIES[name]} package ({err.msg}): pip install "
            f"'lorafuse[{name}]', or drop {name} from --report-to (logging.jsonl has the figures)"
        ) from None


def figures(record: dict) -> dict[str, float]:
    """The numbers of a log record, ``step`` aside."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip


def flat_params(config: dict) -> dict[str, str]:
    """The config as ``{name: text}``, the form every tracker stores parameters in."""
    return {k: v if isinstance(v, str) else repr(v) for k, v in config.items()}


class TensorBoard:
    def __init__(self, output_dir: str, run_name: str, config: dict) -> None:
        require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self.writer.add_text("config", "\n".join(f"{k}: {v}" for k, v in config.items()))

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, output_dir: str, run_name: str, config: dict) -> None:
        wandb = require("wandb")
        directory = os.environ.get("WANDB_DIR") or output_dir
        os.makedirs(directory, exist_ok=True)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT,
                                  name=run_name, dir=directory, config=config,
                                  reinit="create_new")  # fmt: skip
        except Exception as err:  # wandb.errors.*: not logged in, no network in online mode...
            raise TrackerError(f"report_to=wandb: wandb.init failed ({' '.join(str(err).split())}); "
                               "WANDB_MODE=offline logs without a network") from None  # fmt: skip

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, output_dir: str, run_name: str, config: dict) -> None:
        mlflow = require("mlflow")
        from mlflow.entities import Param

        db = os.path.abspath(os.path.join(output_dir, "mlflow.db"))
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{db}"
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        try:
            self.client = mlflow.MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment, run_name=run_name).info.run_id
        except Exception as err:  # ImportError (sqlalchemy), MlflowException (a refused store)
            raise TrackerError(f"report_to=mlflow: tracking URI {uri} cannot take the run "
                               f"({type(err).__name__}: {' '.join(str(err).split())[:300]}); the "
                               "local store needs pip install 'lorafuse[mlflow]'") from None  # fmt: skip
        params = [Param(k, v[:6000]) for k, v in flat_params(config).items()]  # MLflow's limit
        self.client.log_batch(self.run_id, params=params)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackio:
    """trackio's run is its module's current one (``trackio.finish`` ends it, so its exit hook
    finds none). It prints its messages to stdout, which holds the command's summary JSON: they
    go to stderr. Its background CPU sampling stays off: the run holds logging.jsonl's figures."""

    def __init__(self, output_dir: str, run_name: str, config: dict) -> None:
        self.trackio = require("trackio")
        project = os.environ.get("TRACKIO_PROJECT") or PROJECT
        with contextlib.redirect_stdout(sys.stderr):
            self.run = self.trackio.init(project=project, name=run_name, config=config,
                                         embed=False, auto_log_cpu=False, auto_log_gpu=False)  # fmt: skip

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.trackio.finish()


CLASSES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}


class Trackers:
    """The trackers of one run: :meth:`log` sends a log record to each, :meth:`close` ends them."""

    def __init__(self, names: list[str], output_dir: str, config: dict | None = None) -> None:
        unknown = [n for n in names if n not in CLASSES]
        if unknown:
            raise TrackerError(f"report_to: unknown {unknown}; choose from {', '.join(TRACKERS)}")
        for name in names:  # every library first: a missing one stops before any run starts
            require(name)
        run_name = os.path.basename(os.path.abspath(output_dir))
        self.open: list = []
        try:
            for name in names:
                self.open.append(CLASSES[name](output_dir, run_name, dict(config or {})))
        except BaseException:
            self.close()
            raise

    def log(self, record: dict) -> None:
        values = figures(record)
        if values:
            for tracker in self.open:
                tracker.log(int(record["step"]), values)

    def close(self) -> None:
        while self.open:
            self.open.pop().close()
