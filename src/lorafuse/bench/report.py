"""The bench's numbers: each configuration's summary over its runs, the ratios, the roofline
efficiency, and the tables ``lorafuse bench`` prints: the LLM bench's (:func:`format_table`) and
the image bench's (``--task``: :func:`format_image_table`, LoRA overhead over the frozen UNet)."""

from __future__ import annotations

import statistics

from lorafuse.bench.config import COMPILED, CONFIGS, DRIFT_WARN, IMAGE_CONFIGS, QUANTIZED, ROOFLINE

SIDES = (*CONFIGS, *QUANTIZED, *COMPILED)  # every configuration a results dict may hold, in order


def tokens_per_step(spec: dict) -> int:
    """sft, distill (the student's rows): batch x seq; dpo, rm: chosen + rejected; grpo, rloo:
    every completion with its prompt."""
    method = spec.get("method", "sft")
    if method in ("grpo", "rloo"):
        return spec["batch"] * spec["num_generations"] * (spec["seq"] + spec["completion_length"])
    return spec["batch"] * spec["seq"] * (1 if method in ("sft", "distill") else 2)


def summarise(runs: list[dict], tokens_per_step: int) -> dict:
    times = [t for r in runs for t in r["times"]]
    med = statistics.median(times)
    split = {}
    if "gen_times" in runs[0]:  # grpo: generation + scoring, then the update
        gen = [g for r in runs for g in r["gen_times"]]
        upd = [t - g for r in runs for t, g in zip(r["times"], r["gen_times"])]
        split = {"gen_time_s": statistics.median(gen), "update_time_s": statistics.median(upd)}
    return {
        **split,
        "step_time_s": med,
        "step_time_min_s": min(times),
        "tokens_per_s": tokens_per_step / med,
        "peak_mem_mib": statistics.median(r["peak_bytes"] for r in runs) / 2**20,
        "peak_total_mib": statistics.median(r.get("peak_total_bytes", 0) for r in runs) / 2**20,
        "weights_mib": runs[0].get("weight_bytes", 0) / 2**20,
        "baseline_mib": statistics.median(r.get("baseline_bytes", 0) for r in runs) / 2**20,
        "first_loss": runs[0]["losses"][0],
        "n_steps": len(times),
        "warmup_s": statistics.median(r.get("warmup_s", 0.0) for r in runs),
        **_heap_summary(runs),
    }


def _heap_summary(runs: list[dict]) -> dict:
    """Median heap (glibc's, plus lorafuse's large buffers where installed) after each run's
    steps (``process.heap_bytes``), where every run has one."""
    heaps = [r.get("heap_bytes") for r in runs]
    if not heaps or None in heaps:
        return {}
    return {f"heap_{k}_mib": statistics.median(h[k] for h in heaps) / 2**20 for k in heaps[0]}


def ratio(f: dict, s: dict) -> dict:
    split = {}
    if "gen_time_s" in f and "gen_time_s" in s:
        split = {"gen_time": f["gen_time_s"] / s["gen_time_s"],
                 "update_time": f["update_time_s"] / s["update_time_s"]}  # fmt: skip
    return {
        **split,
        "tokens_per_s": f["tokens_per_s"] / s["tokens_per_s"],
        "step_time": f["step_time_s"] / s["step_time_s"],
        "step_time_min": f["step_time_min_s"] / s["step_time_min_s"],
        "peak_mem": f["peak_mem_mib"] / s["peak_mem_mib"],
        "peak_total_mem": f["peak_total_mib"] / s["peak_total_mib"] if s["peak_total_mib"] else 0.0,
    }


def summarise_roofline(runs: list[dict]) -> dict:
    seconds = statistics.median(r["seconds"] for r in runs)
    drifts = [r["drift"] for r in runs if "drift" in r]
    peaks = [r["peak"] for r in runs if "peak" in r]
    peak = {"peak_gflops_per_s": statistics.median(p["gflops_per_s"] for p in peaks),
            "peak_size": peaks[0]["size"]} if peaks else {}  # fmt: skip
    return {
        **peak,
        "seconds": seconds,
        "seconds_per_repeat": [r["seconds"] for r in runs],
        "gflop": runs[0]["flops"] / 1e9,
        "gflops_per_s": runs[0]["flops"] / 1e9 / seconds,
        "matmul_dtype": runs[0]["matmul_dtype"],
        "drift": max(drifts, key=abs) if drifts else None,
    }


def efficiency(roof: dict, runs: list[dict], step_time_s: float) -> dict:
    """The median over ``runs`` of each run's unavoidable product seconds / its median step
    seconds, and the achieved product GFLOP/s at the side's median step time."""
    per_run = [r[ROOFLINE]["seconds"] / statistics.median(r["times"]) for r in runs]
    out = {
        "efficiency": statistics.median(per_run),
        "efficiency_per_run": per_run,
        "achieved_gflops_per_s": roof["gflop"] / step_time_s,
    }
    if roof.get("peak_gflops_per_s"):  # the machine's peak: one large square product
        out["peak_fraction"] = out["achieved_gflops_per_s"] / roof["peak_gflops_per_s"]
    return out


def format_table(results: dict, spec: dict) -> str:
    roof = results.get(ROOFLINE)
    rows = [("", "step s (median)", "step s (min)", "tokens/s", "peak mem MiB", "loss@step1")]
    rows[0] += ("roofline eff.",) if roof else ()
    for name in SIDES:
        if name in results:
            r = results[name]
            rows.append((name, f"{r['step_time_s']:.3f}", f"{r['step_time_min_s']:.3f}",
                         f"{r['tokens_per_s']:.1f}",
                         f"{r['peak_mem_mib']:.0f}", f"{r['first_loss']:.4f}")
                        + ((f"{r['efficiency']:.0%}",) if roof else ()))  # fmt: skip
    ratios = [("ratio", "lorafuse/stock")] + [(f"ratio {n}", f"{n}/stock") for n in COMPILED]
    ratios += [(f"ratio {n}", f"{n}/lorafuse") for n in QUANTIZED]
    for key, label in ratios:
        if key in results:
            q = results[key]
            rows.append((label, f"{q['step_time']:.2f}x", f"{q['step_time_min']:.2f}x",
                         f"{q['tokens_per_s']:.2f}x", f"{q['peak_mem']:.2f}x", "")
                        + (("",) if roof else ()))  # fmt: skip
    _add_total_column(rows, results)
    head = (f"lorafuse bench: {spec['model']} {spec['dtype']} {spec['device']} batch {spec['batch']} "
            f"x seq {spec['seq']}, r={spec['rank']}, grad-ckpt {'on' if spec['grad_ckpt'] else 'off'}")  # fmt: skip
    if spec.get("layers"):
        head += f", first {spec['layers']} layers"
    if spec.get("use_dora"):
        head += "; DoRA (stock = PEFT's DoRA, lorafuse = fused DoRA)"
    if spec.get("method", "sft") in ("dpo", "rm"):
        stock = {"dpo": "TRL DPOTrainer loss", "rm": "TRL RewardTrainer"}[spec["method"]]
        head += (f"; {spec['method']}: {spec['batch']} pairs, chosen + rejected = "
                 f"{2 * spec['batch']} rows; stock = {stock}")  # fmt: skip
    if spec.get("method") == "distill":
        head += (f"; distill: {spec['batch']} rows, completion = 2nd half, a second model as "
                 "teacher, generalized JSD; stock = TRL DistillationTrainer loss")  # fmt: skip
    if spec.get("method") in ("grpo", "rloo"):
        stock = {"grpo": "TRL GRPOTrainer", "rloo": "TRL RLOOTrainer"}[spec["method"]]
        head += (f"; {spec['method']}: {spec['batch']} prompts x {spec['num_generations']} "
                 f"completions of {spec['completion_length']} tokens; stock = {stock}")  # fmt: skip
    lines = [head, *_aligned(rows)]
    split = _split_line(results)
    lines += [split] if split else []
    for name in COMPILED:
        if name in results:
            lines.append(f"{name}: warmup incl. compile {results[name]['warmup_s']:.1f} s "
                         f"(eager lorafuse warmup {results.get('lorafuse', {}).get('warmup_s', 0):.1f} s)")  # fmt: skip
    if roof:
        lines.append(_roofline_line(results, roof))
    lines += [_nf4_line(results, name) for name in QUANTIZED if name in results]
    heap = _heap_line(results)
    return "\n".join(lines + ([heap] if heap else []))


def machine_line(runs: dict[str, list[dict]]) -> str | None:
    """One line on how much of the machine the runs had (``llm.machine_share``), flagged when
    another load competed: then the table's times are not the code's."""
    shares = [r["machine"] for side in runs.values() for r in side if "machine" in r]
    if not shares:
        return None
    cpus, load = min(m["cpus"] for m in shares), max(m["load_avg"] for m in shares)
    line = (f"machine: each run on {cpus} of {shares[0]['machine_cpus']} CPUs, 1-min load "
            f"average up to {load:.1f}")  # fmt: skip
    if cpus < shares[0]["machine_cpus"] or load > cpus + 0.5:  # +0.5: the run's own threads
        line += " -- WARNING: the runs shared their CPUs; these timings are noise"
    return line


def batches_line(runs: dict[str, list[dict]]) -> str | None:
    """Whether stock and lorafuse trained on the same batches, from the runs' ``seen`` records
    (rm: every step's token ids; rloo: every step's prompts and token count, its completions
    being sampled); None where the runs record nothing (sft, dpo, grpo; ``--only``)."""
    sides = {n: [r["seen"] for r in runs.get(n, []) if "seen" in r] for n in CONFIGS}
    if not all(sides.values()):
        return None
    first = sides["stock"][0]
    same = all(s == first for side in sides.values() for s in side)
    steps, tokens = len(first), sorted({r["tokens"] for r in first})
    if same:
        return (f"batches: every run of both sides trained on the same {steps} batches "
                f"({'/'.join(map(str, tokens))} tokens a step)")  # fmt: skip
    return "batches: WARNING: the sides' runs trained on different batches; the ratio is not fair"


def _split_line(results: dict) -> str | None:
    """grpo: each side's median generation (+ scoring) and update seconds, and their ratios."""
    sides = [f"{n} {r['gen_time_s']:.3f} + {r['update_time_s']:.3f}"
             for n in SIDES if "gen_time_s" in (r := results.get(n, {}))]  # fmt: skip
    if not sides:
        return None
    line = "step = generation + update (median s): " + ", ".join(sides)
    q = results.get("ratio", {})
    if "gen_time" in q:
        line += f"; lorafuse/stock: generation {q['gen_time']:.2f}x, update {q['update_time']:.2f}x"
    return line


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """The rows as lines, every column right-aligned to its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]


def _heap_line(results: dict) -> str | None:
    """Each side's heap after its steps (glibc's plus lorafuse's large buffers): what is
    allocated, and what is mapped (the difference is free memory the heap keeps, which the peak
    RSS includes where it was touched)."""
    sides = [f"{name} {r['heap_in_use_mib']:.0f} / {r['heap_mapped_mib']:.0f}"
             for name in SIDES
             if "heap_in_use_mib" in (r := results.get(name, {}))]  # fmt: skip
    if not sides:
        return None
    return ("heap after the steps (glibc malloc + lorafuse's large buffers, MiB in use / mapped; "
            "the rest is freed memory "
            f"kept for reuse, resident where touched): {', '.join(sides)}")  # fmt: skip


def _add_total_column(rows: list, results: dict) -> None:
    """Append "peak total MiB" (weights included, see MemoryProbe.peak_total_bytes) to ``rows``."""
    rows[0] += ("peak total MiB",)
    for i, row in enumerate(rows[1:], 1):
        name = row[0]
        if name in results:
            total = results[name].get("peak_total_mib")  # absent in results of older runs
            rows[i] += (f"{total:.0f}",) if total is not None else ("",)
            continue
        key = "ratio" if name == "lorafuse/stock" else f"ratio {name.rsplit('/', 1)[0]}"
        total = results.get(key, {}).get("peak_total_mem")
        rows[i] += (f"{total:.2f}x",) if total is not None else ("",)


def _nf4_line(results: dict, name: str) -> str:
    """nf4 vs bf16 lorafuse: the QLoRA trade (speed for weight memory) in one line."""
    f, line = results[name], f"{name}: weights {results[name]['weights_mib']:.0f} MiB"
    if "lorafuse" in results:
        b, q = results["lorafuse"], results[f"ratio {name}"]
        line += (f" vs {b['weights_mib']:.0f}; vs lorafuse: tokens/s {q['tokens_per_s']:.2f}x, "
                 f"peak total {f['peak_total_mib']:.0f} / {b['peak_total_mib']:.0f} MiB = "
                 f"{q['peak_total_mem']:.2f}x, peak above the built model {q['peak_mem']:.2f}x")  # fmt: skip
        base = f["baseline_mib"]  # the interpreter and libraries, before any model
        if base:
            ours, theirs = f["peak_total_mib"] - base, b["peak_total_mib"] - b["baseline_mib"]
            line += (f"; without the ~{base:.0f} MiB process baseline {ours:.0f} / {theirs:.0f} "
                     f"MiB = {ours / theirs:.2f}x")  # fmt: skip
    return line


def _roofline_line(results: dict, roof: dict) -> str:
    """One line: what the roofline is, and the product GFLOP/s each side achieves."""
    dtype = roof["matmul_dtype"].removeprefix("torch.")
    sides = ", ".join(
        f"{c} {results[c]['achieved_gflops_per_s']:.1f}" for c in CONFIGS if c in results
    )
    line = (
        f"roofline: {roof['gflop']:.1f} GFLOP/step of unavoidable matrix products ({dtype}, "
        f"causal attention): {roof['seconds']:.3f} s alone = {roof['gflops_per_s']:.1f} GFLOP/s\n"
        f"  eff. = roofline s / median step s, each run's roofline the mean of its timings before"
        f" and after its steps (median over runs); achieved GFLOP/s: {sides}"
    )
    if roof.get("peak_gflops_per_s"):
        n, fractions = roof["peak_size"], ", ".join(
            f"{c} {results[c]['peak_fraction']:.0%}"
            for c in CONFIGS if "peak_fraction" in results.get(c, {})
        )  # fmt: skip
        line += (f"\n  machine peak: {roof['peak_gflops_per_s']:.1f} GFLOP/s (one {n}x{n}x{n} "
                 f"{dtype} product, median over runs); each side's product rate as a fraction of "
                 f"it: {fractions}; the roofline's own shapes reach "
                 f"{roof['gflops_per_s'] / roof['peak_gflops_per_s']:.0%}")  # fmt: skip
    drift = roof.get("drift")
    if drift is not None:
        line += (
            f"\n  drift (roofline after / before the steps - 1, largest over runs): {drift:+.0%}"
        )
        if abs(drift) > DRIFT_WARN:
            line += (f": the machine's speed changed by more than {DRIFT_WARN:.0%} during a run,"
                     " so its efficiency is uncertain by about as much; rerun when it is quiet")  # fmt: skip
    return line


# --------------------------------------------------------------------------------------------
# The image bench (``lorafuse bench --task sd15|sdxl``): steps against the frozen UNet's.


def summarise_image(runs: list[dict]) -> dict:
    """One image configuration over its runs: wall and process-CPU step times, page faults."""
    times = [t for r in runs for t in r["times"]]
    return {
        "step_time_s": statistics.median(times),
        "step_cpu_s": statistics.median(t for r in runs for t in r["cpu_times"]),
        "step_time_min_s": min(times),
        "step_minflt": statistics.median(f for r in runs for f in r["minflt"]),
        "peak_mem_mib": statistics.median(r["peak_bytes"] for r in runs) / 2**20,
        "first_loss": runs[0]["losses"][0],
        "n_steps": len(times),
        "lora_params": runs[0]["lora_params"],
        "unet_params": runs[0]["unet_params"],
    }


def add_overheads(results: dict, ranks: list[int], configs: tuple[str, ...]) -> None:
    """Each label's overhead over ``none`` (wall and CPU), and at each rank, where every LoRA
    configuration ran, lorafuse's overhead over kohya's and whether it met the target."""
    base = results["none"]["step_time_s"]
    base_cpu = results["none"]["step_cpu_s"]
    for r in results.values():
        r["overhead_s"] = r["step_time_s"] - base
        r["overhead_pct"] = 100.0 * r["overhead_s"] / base
        r["cpu_overhead_s"] = r["step_cpu_s"] - base_cpu
        r["cpu_overhead_pct"] = 100.0 * r["cpu_overhead_s"] / base_cpu
    for rank in ranks if set(IMAGE_CONFIGS[1:]) <= set(configs) else ():
        ours, kohya = results[f"lorafuse@r{rank}"], results[f"kohya@r{rank}"]
        peft = results[f"peft@r{rank}"]
        ours["overhead_vs_kohya"] = (
            ours["overhead_s"] / kohya["overhead_s"] if kohya["overhead_s"] > 0 else None
        )
        ours["cpu_overhead_vs_kohya"] = (
            ours["cpu_overhead_s"] / kohya["cpu_overhead_s"]
            if kohya["cpu_overhead_s"] > 0
            else None
        )
        ours["target_met"] = bool(
            ours["overhead_vs_kohya"] is not None
            and ours["overhead_vs_kohya"] <= 1 / 3
            and ours["step_time_s"] <= min(kohya["step_time_s"], peft["step_time_s"])
        )


def _ratio_cell(x) -> str:
    return "" if x is None else f"{x:.2f}"


def format_image_table(results: dict, spec: dict, ranks: list[int]) -> str:
    """Wall-clock and process-CPU step times: on a shared machine the CPU seconds (the work the
    step did, whoever else ran) are the steadier of the two; both are reported."""
    head = ("", "rank", "step s", "ovh ms", "% of none", "ours/kohya", "CPU s", "CPU ovh ms",
            "CPU %", "CPU ours/kohya", "peak MiB", "LoRA params", "target")  # fmt: skip
    rows = [head]
    for label in ["none"] + [f"{c}@r{r}" for r in ranks for c in IMAGE_CONFIGS[1:]]:
        if label not in results:
            continue
        r = results[label]
        config, _, rank = label.partition("@r")
        lora = label != "none"
        rows.append((config, rank or "-", f"{r['step_time_s']:.3f}",
                     f"{1000 * r['overhead_s']:.0f}" if lora else "-",
                     f"{r['overhead_pct']:.1f}%" if lora else "-",
                     _ratio_cell(r.get("overhead_vs_kohya")), f"{r['step_cpu_s']:.3f}",
                     f"{1000 * r['cpu_overhead_s']:.0f}" if lora else "-",
                     f"{r['cpu_overhead_pct']:.1f}%" if lora else "-",
                     _ratio_cell(r.get("cpu_overhead_vs_kohya")), f"{r['peak_mem_mib']:.0f}",
                     f"{r['lora_params'] / 1e6:.2f}M",
                     "" if "target_met" not in r else ("met" if r["target_met"] else "NOT met")))  # fmt: skip
    side = spec["resolution"] // 8
    params = results["none"]["unet_params"] / 1e6
    n = results["none"]["n_steps"]
    lines = [
        f"lorafuse bench --task {spec['task']}: UNet {params:.1f}M params (random weights), "
        f"{spec['dtype']} {spec['device']}, batch {spec['batch']} x {spec['resolution']} px "
        f"({side}x{side} latents), {spec['threads'] or 'default'} threads, AdamW (fused), "
        f"medians of {n} steps",
        *_aligned(rows),
        "ovh = step - none's step (wall / process CPU); target (wall): lorafuse overhead <= 1/3 "
        "of kohya's and lorafuse's step <= both kohya's and peft's",
    ]
    return "\n".join(lines)
