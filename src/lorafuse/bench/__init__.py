"""Training speed of stock transformers + PEFT vs lorafuse, in one run (``lorafuse bench``).

Both sides train the same model, batches and LoRA setup (lorafuse = ``patch_peft_model`` on that
PEFT model); every (repeat, side) runs in a fresh subprocess, alternating, warmup excluded.
Reported: median step time, tokens/s, peak memory above the built model (and total), and the
roofline efficiency (:mod:`lorafuse.roofline`). How each is measured: docs/benchmarks.md.
"""

from __future__ import annotations

from lorafuse.bench.config import (
    COMPILED,
    CONFIGS,
    MODELS,
    NF4,
    NF4_EMB,
    QUANTIZED,
    ROOFLINE,
    TARGETS,
    model_config,
)
from lorafuse.bench.process import spawn, write_json
from lorafuse.bench.report import (
    efficiency,
    format_table,
    ratio,
    summarise,
    summarise_roofline,
    tokens_per_step,
)

__all__ = ["COMPILED", "CONFIGS", "MODELS", "NF4", "NF4_EMB", "QUANTIZED", "ROOFLINE", "TARGETS",
           "compare", "format_table", "model_config", "write_json"]  # fmt: skip


def compare(
    spec: dict,
    repeats: int,
    only: str | None = None,
    profile: bool = False,
    roofline: bool = True,
    compile: bool = False,  # noqa: A002 - the --compile flag
):
    """Run stock and lorafuse ``repeats`` times each, interleaved, each run in a fresh process.

    Returns ``(results, runs)``: per configuration the summary (and ``ratio`` when both ran), and
    the raw per-run measurements. ``spec`` holds the run settings (model, dtype, device, batch,
    seq, steps, warmup, rank, grad_ckpt, backend, threads). With ``roofline`` every run also
    times the unavoidable products before and after its steps: ``results['roofline']`` (over all
    runs) and each side's ``efficiency`` (the median of its runs'). With ``compile`` the
    :data:`COMPILED` configurations run too, each with a ``ratio <name>`` against stock.
    """
    from tqdm import tqdm

    configs = [only] if only else list(CONFIGS)
    if spec.get("quant") == "nf4":
        configs += QUANTIZED
    if compile:
        configs += [c for c in COMPILED if only is None or c.startswith(only)]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    plan = [(rep, c) for rep in range(repeats) for c in configs]  # interleaved
    for rep, c in tqdm(plan, desc="bench runs", unit="run"):
        last = rep == repeats - 1
        profiled = c in ("lorafuse", NF4) and (c == NF4 or spec.get("quant") != "nf4")
        run = {**spec, "config": c, "profile": profile and last and profiled, "roofline": roofline}
        runs[c].append(spawn(run))
    tokens = tokens_per_step(spec)
    results: dict = {c: summarise(runs[c], tokens) for c in configs}
    if "stock" in results and "lorafuse" in results:
        results["ratio"] = ratio(results["lorafuse"], results["stock"])
    for c in COMPILED:
        if "stock" in results and c in results:
            results[f"ratio {c}"] = ratio(results[c], results["stock"])
    for c in QUANTIZED:
        if c in results and "lorafuse" in results:
            results[f"ratio {c}"] = ratio(results[c], results["lorafuse"])
    if roofline:
        results[ROOFLINE] = summarise_roofline([r[ROOFLINE] for c in configs for r in runs[c]])
        for c in configs:
            results[c].update(efficiency(results[ROOFLINE], runs[c], results[c]["step_time_s"]))
    return results, runs
