"""``benchmarks/`` stays runnable and readable without running it: every file parses, every name it
imports from lorafuse exists, every probe states its question, answer and constant, and the
timing goes through ``lorafuse.testing.timing``."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
FILES = sorted(BENCHMARKS.rglob("*.py"))
PROBES = sorted((BENCHMARKS / "probes").glob("*.py"))
LABELS = ("Question:", "Answer:", "Constant:")
# Calls of a clock outside the harness, and why each may stay.
OWN_CLOCKS = {
    "ops/gpu_all.py": "the wall seconds each case took (bookkeeping, not a timing)",
    "serve.py": "a server's start deadline, and the wall time and first-token time of concurrent "
    "client streams (end-to-end throughput of another process, not a call the harness can time)",
    "deploy_runtimes.py": "the arrival time of each streamed token of one generation inside a "
    "runtime (llama.cpp, ONNX Runtime GenAI, OpenVINO GenAI, a lorafuse server), not a call the "
    "harness can time",
    "peer_worker.py": "the steps of another tool's trainer, from its callbacks, in that tool's own "
    "Python environment (where lorafuse and its harness are not installed)",
}


def _rel(path: Path) -> str:
    return str(path.relative_to(BENCHMARKS))


def test_the_suite_is_where_the_readme_says():
    assert FILES and PROBES
    assert (BENCHMARKS / "README.md").is_file()
    assert {p.parent.name for p in FILES} == {"benchmarks", "ops", "probes"}


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_every_benchmark_parses_and_its_lorafuse_imports_exist(path):
    tree = ast.parse(path.read_text(), str(path))  # a syntax error fails here
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "lorafuse":
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:  # a submodule: from lorafuse.ops import swiglu
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lorafuse":
                    importlib.import_module(alias.name)
    assert not missing, f"{_rel(path)} imports names lorafuse no longer has: {missing}"


@pytest.mark.parametrize("path", PROBES, ids=_rel)
def test_every_probe_states_its_question_answer_and_constant(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    head = doc.split("\n\n")[0].splitlines()
    starts = [next((i for i, line in enumerate(head) if line.startswith(x)), None) for x in LABELS]
    assert starts[0] == 0, f"{_rel(path)}: the docstring must open with 'Question:'"
    assert None not in starts and starts == sorted(starts), (
        f"{_rel(path)}: the first paragraph needs {', '.join(LABELS)} lines, in that order"
    )


@pytest.mark.parametrize("path", PROBES, ids=_rel)
def test_every_constant_a_probe_names_exists(path):
    """``ops.x.NAME`` must resolve under lorafuse; a bare ``name`` must appear in a file the
    Constant line names (a C++ function, a test's constant): a refactor that moves the
    constant must move the probe's pointer too."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    head = doc.split("\n\n")[0]
    constant = head[head.index("Constant:") :]
    files = [ROOT / f for f in re.findall(r"\b((?:src|tests)/[\w/]+\.\w+)", constant)]
    missing = []
    for name in re.findall(r"``([\w.]+)``", constant):
        if "." in name:
            module, _, attr = f"lorafuse.{name}".rpartition(".")
            if not hasattr(importlib.import_module(module), attr):
                missing.append(name)
        elif not any(f.is_file() and re.search(rf"\b{name}\b", f.read_text()) for f in files):
            missing.append(name)
    assert not missing, f"{_rel(path)}: its Constant line names what is not there: {missing}"


def test_every_cpp_probe_has_its_python_side():
    for cpp in (BENCHMARKS / "probes").glob("*.cpp"):
        assert cpp.with_suffix(".py").is_file(), f"{cpp.name} has no {cpp.stem}.py to load it"


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_benchmarks_time_through_the_shared_harness(path):
    """A private timer beside ``lorafuse.testing.timing`` is how five copies came about."""
    clocks = {"perf_counter", "process_time", "time", "monotonic", "perf_counter_ns"}
    calls = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in clocks
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "time"
    ]
    if _rel(path) in OWN_CLOCKS:
        return
    assert not calls, (
        f"{_rel(path)} calls a clock itself (lines {calls}): use lorafuse.testing.timing"
    )


@pytest.mark.slow
def test_peers_runs_stock_and_lorafuse_on_the_same_batches(tmp_path):
    """The headline comparison must run: a renamed trainer hook once made every lorafuse row
    'failed' while stock's rows still printed."""
    import json
    import subprocess
    import sys

    out = tmp_path / "peers.json"
    argv = [sys.executable, str(BENCHMARKS / "peers.py"), "--tools", "hf,lorafuse", "--modes",
            "matched", "--dtypes", "fp32", "--batch", "1", "--steps", "1", "--warmup", "0",
            "--repeats", "1", "--threads", "1", "--max-seq-length", "256", "--json", str(out)]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, cwd=tmp_path)
    results = json.loads(out.read_text())["results"]
    errors = {k: r["error"][-600:] for k, r in results.items() if "error" in r}
    assert not errors, errors
    prints = [r["fingerprints"] for r in results.values()]
    assert len(prints) == 2 and prints[0] == prints[1]  # the same rows, in the same order
