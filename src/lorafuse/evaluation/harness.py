"""lm-evaluation-harness tasks scored through lorafuse's own OpenAI server.

The loaded model (base + adapters) is served in this process on a free localhost port (a
throwaway API key) and lm-eval's ``local-completions`` model scores each column against it by
model id: the same requests (token-id prompts, echo + logprobs, stop lists) any harness run
against ``lorafuse serve`` sends, tokenized by the server's own tokenizer (``remote``), so a
GGUF base needs no tokenizer files.

Tasks are names lm-eval knows or task YAML paths. Only tasks whose data is on this machine run
(a ``json``/``csv``/``parquet``/``text``/``arrow`` dataset with local ``data_files``, or a local
dataset directory): a task whose dataset lives on the Hugging Face Hub is refused before the
model loads, naming the dataset, rather than started and left to fail offline.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
from pathlib import Path

import yaml

from lorafuse.errors import LorafuseError

LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}
_SKIP_KEYS = {"sample_len"}  # a count, not a metric


class HarnessError(LorafuseError):
    """lm-eval is missing, a task is unknown or needs a download."""


class _TagsIgnored(yaml.SafeLoader):
    """Reads lm-eval YAML without running it: ``!function`` tags become None."""


_TagsIgnored.add_multi_constructor("!", lambda loader, suffix, node: None)


def _read_yaml(path: Path) -> dict:
    """A task YAML with its ``include`` chain merged (the including file wins)."""
    with open(path, encoding="utf-8") as f:
        cfg = yaml.load(f, Loader=_TagsIgnored) or {}  # a SafeLoader: runs nothing
    merged: dict = {}
    for inc in [] if "include" not in cfg else [cfg.pop("include")]:
        for one in inc if isinstance(inc, list) else [inc]:
            merged.update(_read_yaml(path.parent / one))
    return {**merged, **cfg}


def task_manager(specs: list[str]):
    """lm-eval's TaskManager; its built-in index (thousands of YAML files, slow to scan) only
    when a spec is a name rather than a file."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise HarnessError(
            f"--lm-eval-tasks needs lm-eval: pip install 'lm_eval[api]' ({err})"
        ) from err
    paths = [Path(s) for s in specs if s.endswith((".yaml", ".yml"))]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise HarnessError(f"lm-eval task file not found: {', '.join(missing)}")
    only_files = len(paths) == len(specs)
    return TaskManager(include_path=sorted({str(p.parent) for p in paths}) or None,
                       include_defaults=not only_files)  # fmt: skip


def _leaf_configs(spec: str, manager) -> list[tuple[str, dict]]:
    """(task name, merged config) of every task ``spec`` (name, YAML path, group, tag) runs."""
    if spec.endswith((".yaml", ".yml")):
        cfg = _read_yaml(Path(spec))
        kind = "GROUP" if "group" in cfg else "TASK"
        spec = str(cfg.get("task", spec)) if kind == "TASK" else spec
    else:
        entry = manager.task_index.get(spec)
        if entry is None:
            raise HarnessError(f"lm-eval knows no task, group or tag named {spec!r}")
        kind = entry.kind.name
        if kind == "TAG":
            names = [n for n, e in manager.task_index.items() if spec in e.tags]
            return [leaf for n in names for leaf in _leaf_configs(n, manager)]
        if entry.yaml_path is None:  # a Python-defined task: nothing to inspect
            raise HarnessError(f"lm-eval task {spec!r} is defined in Python; lorafuse eval runs "
                               "YAML tasks with local data files")  # fmt: skip
        cfg = _read_yaml(Path(entry.yaml_path))
    if kind == "GROUP":
        subs = cfg.get("task", [])
        names = [x if isinstance(x, str) else x.get("task", "") for x in
                 (subs if isinstance(subs, list) else [subs])]  # fmt: skip
        return [leaf for n in names for leaf in _leaf_configs(n, manager)]
    return [(spec, cfg)]


def _needs_download(cfg: dict) -> str | None:
    """The remote dataset a task config reads, or None when its data is on this machine."""
    path = cfg.get("dataset_path")
    if path is None:
        return None  # a custom_dataset / Python loader: nothing to fetch that we can see
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if path in LOCAL_BUILDERS and files:
        listed = files.values() if isinstance(files, dict) else [files]
        flat = [f for x in listed for f in (x if isinstance(x, list) else [x])]
        gone = [f for f in flat if not Path(f).exists()]
        return f"{path} data files {gone}" if gone else None
    return None if Path(path).is_dir() else str(path)


def check_tasks(specs: list[str], manager) -> list[str]:
    """Validate ``specs`` before any model loads: every task known and its data local."""
    for spec in specs:
        for name, cfg in _leaf_configs(spec, manager):
            remote = _needs_download(cfg)
            if remote:
                raise HarnessError(
                    f"lm-eval task {name!r} needs a download ({remote}); lorafuse eval runs tasks "
                    "with local data files only: write a task YAML whose dataset_kwargs.data_files "
                    "point at files here"
                )
    return specs


@contextlib.contextmanager
def served(model, tokenizer, model_ids: dict[str, str | None], engine="auto"):
    """``lorafuse serve``'s app on a free localhost port in a thread; yields (url, api key).
    ``engine``: the decode engine the app generates and scores prompts with (create_app's)."""
    import uvicorn

    from lorafuse.serve.server import create_app

    key = secrets.token_hex(16)
    app = create_app(model, tokenizer, model_ids, api_key=key, max_queue=1024, engine=engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise HarnessError("the in-process server for lm-eval did not start")
            thread.join(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", key
    finally:
        server.should_exit = True
        thread.join(30)
        app.state.worker.stop()
        sock.close()


def run_tasks(url: str, key: str, model_id: str, specs: list[str], manager, max_length: int,
              limit: int | None = None, batch_size: int = 8) -> dict:  # fmt: skip
    """{task: {metric: value}} of lm-eval's local-completions scoring ``model_id`` at ``url``."""
    import lm_eval

    # the key goes to the tokenizer routes (auth_token) and, as a header, to the completions
    # (local-completions would otherwise read it from OPENAI_API_KEY)
    args = {"base_url": f"{url}/v1/completions", "model": model_id, "tokenizer_backend": "remote",
            "auth_token": key, "header": {"Authorization": f"Bearer {key}"},
            "max_length": max_length}  # fmt: skip
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=specs,
                                  task_manager=manager, limit=limit, batch_size=batch_size)  # fmt: skip
    return {task: {m: v for m, v in res.items() if m not in _SKIP_KEYS and isinstance(v, int | float)}
            for task, res in out["results"].items()}  # fmt: skip
