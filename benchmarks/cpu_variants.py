"""Training-step speed of each C++ CPU variant against stock and against the torch path, in one run.

``lorafuse bench`` compares stock transformers + PEFT with lorafuse as this CPU loads it; the
variant (``LORAFUSE_CPU_CAPABILITY``) and the backend (``LORAFUSE_KERNELS``) are process-wide
settings, so comparing variants with it takes separate runs minutes apart. This runs, with the
bench's own worker and protocol (:func:`lorafuse.bench.process.spawn`: a fresh process per run,
warmup excluded, the same model, batches and AdamW), interleaved:

* ``stock``: transformers + PEFT;
* ``torch``: lorafuse with ``LORAFUSE_KERNELS=torch`` (the fused model on torch's kernels: what a
  machine without the C++ kernels gets);
* ``cpp <variant>``: lorafuse under ``auto`` with ``LORAFUSE_CPU_CAPABILITY=<variant>``, for each
  variant this CPU runs (:func:`lorafuse.hardware.cpu_variants`); each run's patch report must
  name the variant, or the script stops.

Each repeat runs every configuration once, the order rotated by one per repeat so no side always
follows the same one. Ratios are paired: per repeat, the other side's median step time over this
one's (> 1: faster), then the median over repeats (the range in brackets). A variant forced below
the CPU's own changes lorafuse's C++ code only: torch's kernels (oneDNN, MKL) and the choice of
bf16 products (:func:`lorafuse.hardware.native_low_precision_matmul`) stay the CPU's, so such a
row is not a measurement of an older CPU.

    python benchmarks/cpu_variants.py --model smollm2-135m --dtype bf16 --steps 2 --warmup 1 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics

from lorafuse import backends, hardware
from lorafuse.bench import MODELS, write_json
from lorafuse.bench.process import spawn
from lorafuse.bench.report import summarise, tokens_per_step


def configurations() -> dict[str, tuple[dict, dict]]:
    """label -> (spec fields, environment) for stock, the torch path and each variant here."""
    out = {
        "stock": ({"config": "stock", "backend": None}, {}),
        "torch": ({"config": "lorafuse", "backend": "torch"}, {backends.ENV_VAR: "torch"}),
    }
    for variant in hardware.cpu_variants():
        env = {backends.ENV_VAR: "auto", hardware.CPU_VARIANT_ENV: variant}
        out[f"cpp {variant}"] = ({"config": "lorafuse", "backend": None}, env)
    return out


def run(spec: dict, repeats: int) -> dict[str, list[dict]]:
    """Every configuration ``repeats`` times, interleaved, each in a fresh worker process."""
    configs = configurations()
    labels = list(configs)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for rep in range(repeats):
        for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
            fields, env = configs[label]
            result = spawn({**spec, **fields, "profile": False, "roofline": False}, env=env)
            if label.startswith("cpp "):
                loaded = backends_line(result["report"])
                if not loaded.startswith(label.split()[1] + " "):
                    raise SystemExit(f"{label}: the run loaded {loaded!r}")
                result["loaded"] = loaded
            runs[label].append(result)
            print(f"  repeat {rep + 1}/{repeats} {label:11s} "
                  f"{statistics.median(result['times']):7.2f} s/step", flush=True)  # fmt: skip
    return runs


def backends_line(report: str) -> str:
    """``avx2 (cache ...)``: the C++ variant a run's patch report says it loaded."""
    for line in report.splitlines():
        if line.strip().startswith("C++ kernels:"):
            return line.split(":", 1)[1].strip()
    return "none"


def paired(runs: dict[str, list[dict]], label: str, against: str) -> list[float]:
    """Per repeat: ``against``'s median step time / ``label``'s (> 1: ``label`` is faster)."""
    return [statistics.median(b["times"]) / statistics.median(a["times"])
            for a, b in zip(runs[label], runs[against])]  # fmt: skip


def table(runs: dict[str, list[dict]], spec: dict) -> tuple[str, dict]:
    tokens = tokens_per_step(spec)
    rows, results = [], {}
    for label, label_runs in runs.items():
        s = summarise(label_runs, tokens)
        others = () if label == "stock" else ("stock",) if label == "torch" else ("stock", "torch")
        ratios = {k: paired(runs, label, k) for k in others}
        results[label] = {**s, **{f"vs {k}": v for k, v in ratios.items()}}
        cells = [f"{statistics.median(v):.2f}x [{min(v):.2f}-{max(v):.2f}]" if k in ratios else ""
                 for k, v in ((k, ratios.get(k)) for k in ("stock", "torch"))]  # fmt: skip
        rows.append(f"| {label} | {s['step_time_s']:.2f} | {s['tokens_per_s']:.1f} | "
                    f"{s['peak_mem_mib']:.0f} | {cells[0]} | {cells[1]} |")  # fmt: skip
    head = (f"{spec['model']} {spec['dtype']}, {spec['batch']} x {spec['seq']}, r={spec['rank']}, "
            f"CPU {hardware.cpu_capability()} (runs {', '.join(hardware.cpu_variants())})\n"
            "| configuration | step s | tokens/s | peak MiB | speed vs stock | speed vs torch path |\n"
            "|---|---|---|---|---|---|")  # fmt: skip
    return "\n".join([head, *rows]), results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="smollm2-135m")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=2, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each run")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    spec = {k: getattr(args, k) for k in ("model", "dtype", "batch", "seq", "rank", "steps",
                                          "warmup", "threads")}  # fmt: skip
    spec.update(device="cpu", grad_ckpt=False)
    text, results = table(run(spec, args.repeats), spec)
    print(text)
    if args.json:
        write_json(args.json, {"spec": spec, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
