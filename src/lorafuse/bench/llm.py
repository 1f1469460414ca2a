"""One LLM bench run, inside its worker process: build the configuration's model, time its steps
(with the roofline timed right before and after them) and measure its peak memory."""

from __future__ import annotations

from lorafuse.bench.config import (
    QUANTIZED,
    ROOFLINE,
    TARGETS,
    model_config,
)
from lorafuse.bench.model import build_model, finish_step
from lorafuse.bench.process import (
    MemoryProbe,
    heap_bytes,
    process_bytes,
    release_free_memory,
    sync,
)
from lorafuse.bench.profile import profiled


def token_batches(spec: dict, n: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    vocab = model_config(spec["model"]).vocab_size
    return [torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=g) for _ in range(n)]


def train_step(model, opt, ids) -> float:
    return finish_step(model(input_ids=ids, labels=ids).loss, opt)


def run_worker(spec: dict) -> dict:
    """Build, warm up, time ``spec['steps']`` steps; return times, losses and peak memory, and
    with ``spec['roofline']`` the unavoidable products timed right before and right after the
    steps (:func:`run_roofline`, :func:`bracketed`)."""
    import time

    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    total = spec["warmup"] + spec["steps"]
    baseline = process_bytes(device)
    if spec.get("method", "sft") == "sft":
        model, step = build_model(spec), train_step
        batches = [b.to(device) for b in token_batches(spec, total)]
    elif spec["method"] == "grpo":
        from lorafuse.bench.grpo import grpo_prompts, grpo_setup

        (model, step), batches = grpo_setup(spec), grpo_prompts(spec, total)
    elif spec["method"] == "rloo":
        from lorafuse.bench.grpo import grpo_prompts
        from lorafuse.bench.rloo import rloo_setup

        (model, step), batches = rloo_setup(spec), grpo_prompts(spec, total)
    elif spec["method"] == "rm":
        from lorafuse.bench.preference import preference_pairs
        from lorafuse.bench.reward import reward_setup

        (model, step), batches = reward_setup(spec), preference_pairs(spec, total)
    elif spec["method"] == "distill":
        from lorafuse.bench.distill import distill_rows, distill_setup

        (model, step), batches = distill_setup(spec), distill_rows(spec, total)
    else:
        from lorafuse.bench.preference import preference_pairs, preference_setup

        (model, step), batches = preference_setup(spec), preference_pairs(spec, total)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    weights = _model_bytes(model)
    before = run_roofline(spec, peak=True) if spec.get("roofline") else None  # again after
    release_free_memory()  # build-time garbage (e.g. the dense weights NF4 replaced)
    probe = MemoryProbe(device)
    probe.start()
    times, losses, warmup_s = [], [], 0.0
    for i, ids in enumerate(batches):
        sync(device)
        t0 = time.perf_counter()
        losses.append(step(model, opt, ids))
        sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
        else:
            warmup_s += time.perf_counter() - t0  # includes torch.compile's compile time
    out = {"times": times, "losses": losses, "peak_bytes": probe.peak_bytes(), "warmup_s": warmup_s}
    if hasattr(step, "gen_times"):  # grpo: the generation part of each timed step
        out["gen_times"] = step.gen_times[spec["warmup"] :]
    if hasattr(step, "seen"):  # rm, rloo: what every step (warmup too) trained on
        out["seen"] = step.seen
    out.update(
        peak_total_bytes=probe.peak_total_bytes(), start_bytes=probe.base, weight_bytes=weights
    )
    out["baseline_bytes"] = baseline
    out["machine"] = machine_share()
    out["heap_bytes"] = heap_bytes() if device.type == "cpu" else None  # what the steps left
    if spec["config"].removesuffix("+compile") in ("lorafuse", *QUANTIZED):
        out["report"] = str(model.lorafuse_report)
    if spec.get("profile") and step is train_step:
        out["profile"] = profiled(lambda: train_step(model, opt, batches[-1]))
    if spec.get("roofline"):  # after the memory probe: its operands do not count as the step's
        del model, opt, batches
        release_free_memory()
        out[ROOFLINE] = bracketed(before, run_roofline(spec))
    return out


def machine_share() -> dict:
    """What the run had of the machine: the CPUs it may run on and the 1-min load average at its
    end. On a shared machine a number taken while the load exceeded those CPUs is noise (other
    sessions' ``nice`` does not help under the kernel's per-session autogroup scheduling)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpus": cpus, "load_avg": os.getloadavg()[0], "machine_cpus": os.cpu_count()}


def bracketed(before: dict, after: dict) -> dict:
    """The roofline timed before and after one run's steps: ``seconds`` is their mean (the steps
    ran in between), ``drift`` = after / before - 1 (how much the machine's speed moved); the
    per-product rows are the later timing's."""
    mean = (before["seconds"] + after["seconds"]) / 2
    drift = after["seconds"] / before["seconds"] - 1
    return {**after, "seconds": mean, "seconds_before": before["seconds"],
            "seconds_after": after["seconds"], "drift": drift,
            **({"peak": before["peak"]} if "peak" in before else {})}  # fmt: skip


def adamw(params):
    """AdamW as both sides run it by default: fused where the device has the kernel (HF Trainer's
    ``adamw_torch_fused`` since torch 2.8; ``lorafuse train``), else foreach. The same optimizer
    on both sides, so the ratio compares the forward and backward passes."""
    import torch

    try:
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    except (RuntimeError, TypeError):  # a device / dtype without the fused kernel
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def _model_bytes(model) -> int:
    """Bytes of every parameter and buffer as held (NF4 buffers at their packed size)."""
    # by storage: tied weights count once, NF4 experts' zero-stride placeholders as what they hold
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}  # fmt: skip
    return sum(storages.values())


def run_roofline(spec: dict, peak: bool = False) -> dict:
    """The unavoidable matrix products of one step of ``spec``, timed alone (same threads); with
    ``peak`` also the machine's peak product rate (``roofline.peak_product``)."""
    from lorafuse import roofline
    from lorafuse.dtypes import parse_dtype

    config = model_config(spec["model"])
    products = roofline.training_products(config, spec["batch"], spec["seq"], spec["rank"], TARGETS)
    dtype = parse_dtype(spec["dtype"])
    out = roofline.time_products(products, spec["device"], dtype)
    if peak:
        out["peak"] = roofline.peak_product(spec["device"], dtype)
    return out
