"""lorafuse against the other CPU trainers on one job: stock transformers ``Trainer`` + PEFT, TRL's
``SFTTrainer``, Unsloth's CPU backend and ms-swift's ``swift sft``, each in its own Python.

The job: SmolLM2-135M-Instruct (the HF dir lorafuse converts from its built-in GGUF), LoRA r=16
(alpha 16) on all seven projections, the demo data (``src/lorafuse/data/demo/train.jsonl``, about
48 tokens an example) tokenized and loss-masked once by lorafuse and handed to every tool in the
same order, ``--batch`` rows a step, fp32 and bf16 weights. ``matched`` runs every tool with the
same settings (no gradient checkpointing, no packing, no autocast, fused AdamW at a constant lr,
clipping at 1, the same batches: checked by a fingerprint of every batch); ``defaults`` lets each
tool choose its own (TRL: gradient checkpointing and bf16 autocast; Unsloth: its checkpointing;
ms-swift: its checkpointing and a data-loader worker; lorafuse: packing into rows of
``--max-seq-length``), the batch size and data kept. Tools run one after another in fresh
processes, interleaved and rotated per repeat; warmup steps are excluded; tokens/s counts real
(unpadded) tokens. See ``benchmarks/peer_worker.py`` for what each tool runs and measures.

    python benchmarks/peers.py --unsloth-python /work/venvs/unsloth/bin/python \\
        --swift-python /work/venvs/swift/bin/python --dtypes fp32,bf16 --batch 2 --repeats 3

Peers live in their own virtual environments (never in lorafuse's: they pin other torch /
transformers / TRL versions); the script finds them by flag or environment variable
(``LORAFUSE_UNSLOTH_PYTHON``, ``LORAFUSE_SWIFT_PYTHON``). To create them (CPU torch):

    python3.11 -m venv /opt/venvs/unsloth && /opt/venvs/unsloth/bin/pip install \\
        --extra-index-url https://download.pytorch.org/whl/cpu unsloth unsloth_zoo
    python3.11 -m venv /opt/venvs/swift && /opt/venvs/swift/bin/pip install \\
        --extra-index-url https://download.pytorch.org/whl/cpu torch ms-swift

Stock HF and TRL run in lorafuse's own environment (their versions are printed). Nothing here is
part of the test suite; it takes minutes per run (Unsloth's import alone takes ~10-50 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lorafuse.bench.process import write_json

WORKER = Path(__file__).with_name("peer_worker.py")
ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("hf", "trl", "unsloth", "swift", "lorafuse", "lorafuse-int8")
NAMES = {"hf": "HF Trainer + PEFT", "trl": "TRL SFTTrainer", "unsloth": "Unsloth (CPU)",
         "swift": "ms-swift sft", "lorafuse": "lorafuse",
         "lorafuse-int8": "lorafuse (int8)"}  # fmt: skip
VENV_ENV = {"unsloth": "LORAFUSE_UNSLOTH_PYTHON", "swift": "LORAFUSE_SWIFT_PYTHON"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def prepare(args) -> dict:
    """The job every worker gets: model dir, and the demo rows (lorafuse's tokens and loss masks)
    in the order lorafuse's trainer takes them (its seeded shuffle, then epoch 0's permutation),
    with each row's conversation (ms-swift reads those)."""
    import random

    from transformers import AutoTokenizer

    from lorafuse.data.dataset import DataSpec, build
    from lorafuse.data.formats import read_examples
    from lorafuse.models.source import resolve_model_source
    from lorafuse.train.data_order import epoch_order

    model_dir = resolve_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = DataSpec(train_files=[args.data], max_seq_length=args.max_seq_length, packing=False,
                    seed=args.seed)  # fmt: skip
    data = build(spec, tokenizer)
    examples = read_examples([args.data])
    random.Random(args.seed).shuffle(examples)  # build()'s shuffle (same seed, same call)
    if len(examples) != len(data.train):
        raise SystemExit(f"{args.data}: {len(examples)} records but {len(data.train)} rows "
                         "(some dropped or truncated); use a larger --max-seq-length")  # fmt: skip
    need = args.batch * (args.warmup + args.steps)
    order = epoch_order(len(data.train), args.seed, 0)[:need]
    if len(order) < need:
        raise SystemExit(f"{need} rows needed, {args.data} has {len(data.train)}")
    rows = [{"input_ids": data.train[i].input_ids, "labels": data.train[i].labels}
            for i in order]  # fmt: skip
    records = [{"messages": examples[i].messages, **rows[k]} for k, i in enumerate(order)]
    return {"model_dir": model_dir, "data_file": os.path.abspath(args.data), "rows": rows,
            "records": records, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "lr": args.lr, "seed": args.seed, "rank": args.rank, "alpha": args.rank,
            "targets": TARGETS, "max_seq_length": args.max_seq_length,
            "threads": args.threads, "swift_args": args.swift_args.split()}  # fmt: skip


def python_of(tool: str, args) -> str | None:
    """The interpreter a tool runs in: lorafuse's own for hf / trl / lorafuse, else its venv."""
    if tool not in VENV_ENV:  # hf, trl, lorafuse, lorafuse-int8
        return sys.executable
    return getattr(args, f"{tool}_python") or os.environ.get(VENV_ENV[tool])


def run_one(job: dict, python: str, tool: str) -> dict:
    """One worker process; its result, or ``{"error": ...}`` (a failed tool is reported, and the
    others still run)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    if tool in VENV_ENV:  # a peer's venv sees none of lorafuse's paths
        env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        job_file, out_file = Path(tmp, "job.json"), Path(tmp, "out.json")
        job_file.write_text(json.dumps({**job, "tool": tool}))
        proc = subprocess.run([python, str(WORKER), str(job_file), str(out_file)], env=env,
                              capture_output=True, text=True, cwd=tmp)  # fmt: skip
        if proc.returncode != 0 or not out_file.is_file():
            return {"error": f"exit {proc.returncode}: {proc.stderr[-2500:]}"}
        return json.loads(out_file.read_text())


def rate(run: dict, warmup: int, clock: str) -> float:
    """Real tokens of the timed steps over their seconds on ``clock`` (wall, or this process's CPU
    seconds: with one thread on a shared machine, the work itself)."""
    tokens = sum(p[0] for p in run["fingerprints"][warmup:])
    return tokens / sum(run[clock][warmup:])


def summarise(runs: list[dict], warmup: int) -> dict:
    """Median over runs of tokens/s (wall) and tokens per CPU second, CPU seconds per step, peak
    memory; losses of the first run."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0]["error"]}
    tps = [rate(r, warmup, "wall") for r in good]
    first = good[0]
    return {"tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
            "tokens_per_cpu_s": statistics.median(rate(r, warmup, "cpu") for r in good),
            "cpu_s_per_step": statistics.median(statistics.median(r["cpu"][warmup:])
                                                for r in good),
            "peak_mib": statistics.median(r["peak_bytes"] for r in good) / 2**20,
            "peak_total_mib": statistics.median(r["peak_total_bytes"] for r in good) / 2**20,
            "losses": first["losses"], "fingerprints": first["fingerprints"],
            "versions": first["versions"], "settings": first.get("settings", {}),
            "load_avg": max(r["load_avg"] for r in good), "runs": len(good),
            "failed": len(runs) - len(good)}  # fmt: skip


def paired(runs: dict, key: str, base: str) -> float | None:
    """Median over repeats of tokens/s(key) / tokens/s(base) within the same repeat."""
    out = []
    for a, b in zip(runs.get(key, []), runs.get(base, [])):
        if "error" in a or "error" in b:
            continue
        out.append(a["_tps"] / b["_tps"])
    return statistics.median(out) if out else None


def label(tool: str, mode: str) -> str:
    return tool if mode == "matched" else f"{tool}/defaults"


def table(results: dict, runs: dict, dtype: str, steps: list[int], clock: str) -> list[str]:
    head = ("config", "tokens/s", "tokens/CPU-s", "x HF", "x best peer", "CPU s/step",
            "peak MiB", "total MiB",
            *(f"loss@{s}" for s in steps), "same batches", "settings")  # fmt: skip
    rows = [head]
    keys = [k for k in results if k[0] == dtype]
    matched = [k for k in keys if "/" not in k[1] and "fingerprints" in results[k]]
    base = (dtype, "hf") if (dtype, "hf") in matched else (matched[0] if matched else None)
    metric = "tokens_per_s" if clock == "wall" else "tokens_per_cpu_s"
    peers = [k for k in keys if not k[1].startswith("lorafuse") and metric in results[k]]
    best = max(peers, key=lambda k: results[k][metric], default=None)
    for k in keys:
        r = results[k]
        if "error" in r:
            rows.append((k[1], "failed", *[""] * (len(head) - 2)))
            continue
        vs_hf = paired(runs, k, (dtype, "hf")) if k[1] != "hf" else None
        vs_best = paired(runs, k, best) if best and k != best else None
        same = "-"
        if r["fingerprints"] and r["fingerprints"][0][1] is None:
            same = "unchecked"  # collated in a data-loader worker
        elif base is not None and not k[1].endswith("defaults"):
            same = "yes" if r["fingerprints"] == results[base]["fingerprints"] else "NO"
        loss = [f"{r['losses'][s]:.3f}" if s < len(r["losses"]) else "" for s in steps]
        settings = ", ".join(f"{a}={b}" for a, b in r["settings"].items() if a != "argv")
        rows.append((k[1], f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_cpu_s']:.0f}",
                     _x(vs_hf), _x(vs_best),
                     f"{r['cpu_s_per_step']:.2f}", f"{r['peak_mib']:.0f}",
                     f"{r['peak_total_mib']:.0f}", *loss, same, settings))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    return [
        f"{dtype} (best peer: {best[1] if best else '-'}; x = paired ratio of tokens per "
        f"{'wall' if clock == 'wall' else 'CPU'} second within a repeat):",
        *lines,
    ]


def _x(v) -> str:
    return "" if v is None else f"{v:.2f}x"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tools",
        default=",".join(TOOLS[:-1]),
        help="comma-separated: " + ", ".join(TOOLS) + " (lorafuse-int8: load_in_int8, "
        "on CPUs with AMX / AVX-512-VNNI)",
    )
    p.add_argument("--modes", default="matched,defaults", help="matched and/or defaults")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--batch", type=int, default=2, help="rows per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=3407)
    p.add_argument(
        "--max-seq-length",
        type=int,
        default=256,
        help="truncation for every tool; lorafuse's packed row length in defaults",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads in every worker")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="what the ratios compare: tokens per wall second, or per CPU second of "
        "the worker (with --threads 1 on a shared machine: the work itself)",
    )
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: built-in SmolLM2)")
    p.add_argument("--data", default=str(ROOT / "src/lorafuse/data/demo/train.jsonl"))
    p.add_argument(
        "--unsloth-python", default=None, help=f"Unsloth venv's python (or ${VENV_ENV['unsloth']})"
    )
    p.add_argument(
        "--swift-python", default=None, help=f"ms-swift venv's python (or ${VENV_ENV['swift']})"
    )
    p.add_argument(
        "--swift-args",
        default="",
        help="extra `swift sft` arguments for every swift run (e.g. '--use_logits_to_keep false')",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one step after warmup in each tool's last run (torch.profiler)",
    )
    p.add_argument("--json", default=None, help="write every run's raw measurements here")
    args = p.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = (set(tools) - set(TOOLS)) | (set(modes) - {"matched", "defaults"}) | (
        set(dtypes) - {"fp32", "bf16"})  # fmt: skip
    if bad:
        p.error(f"unknown {sorted(bad)}")
    skipped = [t for t in tools if python_of(t, args) is None]
    for t in skipped:
        print(f"{t}: skipped (no --{t}-python / ${VENV_ENV[t]})", file=sys.stderr)
    tools = [t for t in tools if t not in skipped]
    job = prepare(args)
    configs = [(d, t, m) for d in dtypes for m in modes for t in tools]
    runs: dict = {}
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    for rep in range(args.repeats):
        shift = rep % len(configs)
        for d, t, m in configs[shift:] + configs[:shift]:  # rotated: no fixed neighbour
            spec = {
                **job,
                "dtype": d,
                "mode": m,
                "profile": args.profile and rep == args.repeats - 1,
            }
            out = run_one(spec, python_of(t, args), t)
            if "error" not in out:
                out["_tps"] = rate(out, args.warmup, args.clock)
            runs.setdefault((d, label(t, m)), []).append(out)
            state = "failed" if "error" in out else f"{out['_tps']:.1f} tokens/{args.clock}-s"
            print(f"repeat {rep + 1}/{args.repeats} {d} {label(t, m)}: {state}", file=sys.stderr)
    # every run in configuration order (the rotation only changed when they ran)
    runs = {k: runs[k] for k in [(d, label(t, m)) for d, t, m in configs] if k in runs}
    results = {k: summarise(v, args.warmup) for k, v in runs.items()}
    steps = sorted({0, args.warmup, args.warmup + args.steps - 1})
    print(f"\nlorafuse benchmarks/peers.py: SmolLM2-135M-Instruct, LoRA r={args.rank} on 7 "
          f"projections, demo data, {args.batch} rows/step, {args.steps} timed steps after "
          f"{args.warmup} warmup, {args.repeats} repeats (medians), {args.threads or 'default'} "
          f"threads, load average after {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    for d in dtypes:
        print("\n".join(table(results, runs, d, steps, args.clock)))
    print("versions:")
    for t in tools:
        r = next((v for k, v in results.items() if k[1].split("/")[0] == t and "versions" in v),
                 None)  # fmt: skip
        if r:
            print(f"  {NAMES[t]}: " + ", ".join(f"{a} {b}" for a, b in r["versions"].items()))
    for k, r in results.items():
        if "error" in r:
            print(f"{k}: {r['error']}", file=sys.stderr)
        elif r["settings"].get("argv"):
            print(f"{k[0]} {k[1]}: swift sft {r['settings']['argv']}")
    if args.profile:
        for k, v in runs.items():
            table_ = next((r.get("profile") for r in reversed(v) if r.get("profile")), None)
            if table_:
                print(f"\n--- {k[0]} {k[1]}: one step, torch.profiler (self CPU time)\n{table_}")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": {f"{d} {c}": r for (d, c), r
                                                               in results.items()},
                               "runs": {f"{d} {c}": v for (d, c), v in runs.items()}})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
