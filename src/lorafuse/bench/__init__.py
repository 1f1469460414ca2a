"""Training speed of stock transformers + PEFT vs lorafuse, in one run (``lorafuse bench``).

Both configurations train the same model (same seed, same random weights) on the same random
token batches with the same LoRA setup (r on all seven projections, AdamW on the adapters);
lorafuse is ``patch_peft_model`` applied to that very PEFT model. Gradient checkpointing is off in
both unless ``--grad-ckpt``.

Every (repeat, configuration) pair runs in a **fresh subprocess**, alternating stock / lorafuse,
so neither inherits the other's allocator state, caches or memory high-water mark, and machine
noise hits both alike. Warmup steps are excluded. Reported per configuration: median step time,
tokens/s (batch*seq / median step time), and peak memory:

* CPU: peak resident set size during training minus the RSS right after the model was built.
  The kernel's high-water mark (``VmHWM``) is reset through ``/proc/self/clear_refs`` once the
  model exists, so model construction does not count; this is allocator-independent (it sees
  glibc, oneDNN and torch allocations alike).
* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the memory
  allocated right after the model was built.

Also reported, weights included: ``peak total MiB``, the process's whole RSS high-water mark
during the steps (CUDA: every allocated byte), after the built model's build-time garbage was
handed back to the OS (``malloc_trim``), with the worker's pre-model RSS (interpreter and
libraries, ``baseline_mib``) and the model's parameter + buffer bytes (``weights_mib``) in the
JSON. ``--quant nf4`` adds ``lorafuse-nf4``: the same model with every base linear but the lm_head
NF4-quantised (as ``load_in_4bit=True``), and ``lorafuse-nf4+emb``: the embeddings and lm_head too
(``quantize_embeddings=True``), each compared with ``lorafuse`` (tokens/s, peak memory).

With the roofline on (the default; ``--no-roofline`` skips it), every run also times, right
before and right after its steps and in the same process, the matrix products a step cannot
avoid, alone, with the run's shapes (:mod:`lorafuse.roofline`): the run's efficiency = the mean of
those two times / its median step time, and each side reports the median of its runs'
efficiencies. Timed next to the steps it divides, the roofline sees the same phase of a shared
machine (separate processes minutes apart saw the products alone take 1.06 to 1.80 s for the same
SmolLM2 step); timed on both sides of them, a phase change during the steps shows as ``drift``
(after / before - 1), printed with the table, instead of skewing the efficiency unseen (one
roofline timed after the steps read 29% for a step whose code measured 55% the day before).

On an AVX2-only CPU bf16 matrix products run ~100x slower than fp32 (no AVX-512-BF16/AMX), so
stock bf16 at 4 x 512 takes minutes per step; measure bf16 with e.g. ``--batch 1 --seq 128``.
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
