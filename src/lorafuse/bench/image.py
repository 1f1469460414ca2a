"""UNet LoRA training speed: no LoRA, kohya's unfused LoRA, PEFT on diffusers, lorafuse (one run).

``lorafuse bench --task sd15|sdxl``: the real SD1.5 / SDXL UNet architecture with random weights
(or ``--unet-config``); one step = UNet forward + MSE + backward + fused AdamW on the LoRA
parameters, for ``none`` / ``kohya`` / ``peft`` / ``lorafuse`` on the same kohya targets, with
:mod:`lorafuse.bench`'s protocol and the glibc settings of :data:`STEADY_MALLOC`. Why each
choice: docs/image.md.
"""

from __future__ import annotations

import argparse
import json
import os

from lorafuse.bench.config import IMAGE_CONFIGS
from lorafuse.bench.process import STEADY_MALLOC, MemoryProbe, spawn, sync, worker_entry, write_json
from lorafuse.bench.profile import profiled
from lorafuse.bench.report import add_overheads, format_image_table, summarise_image
from lorafuse.errors import LorafuseError

TASKS = ("sd15", "sdxl")
CONFIGS = IMAGE_CONFIGS
LORA_CONFIGS = CONFIGS[1:]

# runwayml/stable-diffusion-v1-5 unet/config.json (the fields that differ from diffusers' defaults)
SD15_UNET = dict(sample_size=64, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                 cross_attention_dim=768, attention_head_dim=8)  # fmt: skip
# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json
SDXL_UNET = dict(sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
                 cross_attention_dim=2048, use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816)  # fmt: skip


def unet_config(task: str, path: str | None = None) -> dict:
    """The UNet config: ``path`` (a config.json, a UNet dir, or a diffusers model dir with
    ``unet/``) or the built-in SD1.5 / SDXL base architecture."""
    if task not in TASKS:
        raise LorafuseError(f"unknown image task {task!r}; choose one of {', '.join(TASKS)}")
    if path is None:
        return dict(SD15_UNET if task == "sd15" else SDXL_UNET)
    for cand in (
        path,
        os.path.join(path, "config.json"),
        os.path.join(path, "unet", "config.json"),
    ):
        if os.path.isfile(cand):
            with open(cand) as f:
                return json.load(f)
    raise LorafuseError(f"--unet-config {path}: no config.json there (nor unet/config.json)")


# --------------------------------------------------------------------------------------------
# One run (in a subprocess).


def _build(spec: dict):
    """The UNet (frozen, train mode) with the configuration's LoRA; returns (unet, lora params)."""
    import torch
    from diffusers import UNet2DConditionModel

    from lorafuse.dtypes import parse_dtype
    from lorafuse.image.network import UNET_TARGETS, LoRANetwork, find_targets

    dtype = parse_dtype(spec["dtype"])
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(spec["unet_config"]).to(spec["device"])
    if dtype != torch.float32:
        unet.to(dtype=dtype)
    unet.requires_grad_(False).train()
    targets = find_targets(unet, UNET_TARGETS)
    r, config = spec["rank"], spec["config"]
    if config == "none":
        for _, layer in targets:
            layer.register_forward_hook(_cut)
        return unet, [], "no LoRA"
    if config == "peft":
        from peft import LoraConfig

        unet.add_adapter(LoraConfig(r=r, lora_alpha=r, target_modules=[p for p, _ in targets]))
        params = [p for p in unet.parameters() if p.requires_grad]
        n = sum(1 for name, _ in unet.named_modules() if name.endswith("lora_A.default"))
        return unet, params, f"PEFT: {n} LoRA modules"
    net = LoRANetwork.create(unet, [], dim=r, alpha=r, fused=config == "lorafuse",
                             backend=spec["backend"])  # fmt: skip
    net.to(device=spec["device"], dtype=dtype).apply_to()
    return unet, list(net.parameters()), net.report()


def _cut(module, args, output):
    """``none``: cut the graph at each target layer's output, as a LoRA branch would join it."""
    return output if output.requires_grad else output.detach().requires_grad_(True)


def _inputs(spec: dict, n: int) -> list[dict]:
    """Random latents (B, 4, res/8, res/8), timesteps, text states (B, 77, cross_dim), target;
    SDXL-style UNets also get ``added_cond_kwargs`` (pooled text embeds + 6 time ids)."""
    import torch

    from lorafuse.dtypes import parse_dtype

    cfg, b, side = spec["unet_config"], spec["batch"], spec["resolution"] // 8
    dtype = parse_dtype(spec["dtype"])
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        kw = {
            "sample": torch.randn(b, cfg.get("in_channels", 4), side, side, generator=g),
            "timestep": torch.randint(0, 1000, (b,), generator=g),
            "encoder_hidden_states": torch.randn(b, 77, cfg["cross_attention_dim"], generator=g),
        }
        if cfg.get("addition_embed_type") == "text_time":
            pooled = (
                cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
            )
            kw["added_cond_kwargs"] = {"text_embeds": torch.randn(b, pooled, generator=g),
                                       "time_ids": torch.tensor([[side * 8.0] * 2 + [0.0] * 2
                                                                 + [side * 8.0] * 2] * b)}  # fmt: skip
        target = torch.randn(b, cfg.get("out_channels", 4), side, side, generator=g)
        out.append(_to(kw, spec["device"], dtype) | {"target": target.to(spec["device"], dtype)})
    return out


def _to(obj, device, dtype):
    if isinstance(obj, dict):
        return {k: _to(v, device, dtype) for k, v in obj.items()}
    return obj.to(device, dtype if obj.is_floating_point() else obj.dtype)


def _step(unet, opt, batch: dict) -> float:
    kw = {k: v for k, v in batch.items() if k != "target"}
    pred = unet(**kw).sample
    loss = (pred.float() - batch["target"].float()).pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def run_worker(spec: dict) -> dict:
    """Build, warm up, time ``spec['steps']`` steps; times, losses, peak memory, report."""
    import resource
    import time

    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    unet, params, report = _build(spec)
    # the training engine's optimizer (lorafuse.train.optim), the same for every configuration
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True) if params else None
    total = spec["warmup"] + spec["steps"]
    batches = _inputs(spec, total)
    probe = MemoryProbe(device)
    probe.start()
    times, cpu_times, losses, faults = [], [], [], []
    for i, batch in enumerate(batches):
        sync(device)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(_step(unet, opt, batch))
        sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    malloc_env = {k: os.environ.get(k) for k in STEADY_MALLOC}
    out = {"times": times, "cpu_times": cpu_times, "minflt": faults, "malloc_env": malloc_env,
           "losses": losses, "peak_bytes": probe.peak_bytes(), "report": report,
           "unet_params": sum(p.numel() for p in unet.parameters() if not p.requires_grad),
           "lora_params": sum(p.numel() for p in params)}  # fmt: skip
    if spec.get("profile"):
        out["profile"] = profiled(lambda: _step(unet, opt, batches[-1]))
    return out


# --------------------------------------------------------------------------------------------
# Orchestration (the numbers and the table: lorafuse.bench.report).


def _label(config: str, rank: int | None) -> str:
    return config if config == "none" else f"{config}@r{rank}"


def compare(spec: dict, ranks: list[int], repeats: int, profile: bool = False,
            configs: tuple[str, ...] = CONFIGS):  # fmt: skip
    """Every configuration in ``configs`` (``none``, the reference, always) at every rank
    (``none`` once per repeat), ``repeats`` times, interleaved, each run in a fresh process.
    Returns ``(results, runs)`` keyed by label (``none``, ``kohya@r8``...): summaries with
    overhead over ``none`` (and lorafuse's over kohya's when both ran), and the raw runs."""
    from tqdm import tqdm

    lora = [c for c in LORA_CONFIGS if c in configs]
    plan = [p for rep in range(repeats)
            for p in [(rep, "none", None)] + [(rep, c, r) for r in ranks for c in lora]]  # fmt: skip
    runs: dict[str, list[dict]] = {}
    for rep, config, rank in tqdm(plan, desc="bench runs", unit="run"):
        last = rep == repeats - 1 and rank == max(ranks) and config in ("kohya", "lorafuse")
        run_spec = {**spec, "config": config, "rank": rank, "profile": profile and last}
        runs.setdefault(_label(config, rank), []).append(
            spawn(run_spec, module="lorafuse.bench.image", env=STEADY_MALLOC)
        )
    results = {label: summarise_image(rs) for label, rs in runs.items()}
    add_overheads(results, ranks, configs)
    return results, runs


def run(spec: dict, ranks: list[int], repeats: int, profile: bool = False,
        json_path: str | None = None, configs: tuple[str, ...] = CONFIGS) -> tuple[dict, dict]:  # fmt: skip
    """Run the comparison, print the table (and profiles), optionally write JSON."""
    results, runs = compare(spec, ranks, repeats, profile, configs)
    if json_path:
        from lorafuse import backends

        write_json(json_path, {"results": results, "spec": spec, "ranks": ranks,
                               "backends": backends.describe(), "runs": runs})  # fmt: skip
    print(format_image_table(results, spec, ranks))
    if f"lorafuse@r{ranks[0]}" in runs:
        print(runs[f"lorafuse@r{ranks[0]}"][-1]["report"])
    for label in (f"kohya@r{max(ranks)}", f"lorafuse@r{max(ranks)}"):
        for r in runs.get(label, []):
            if "profile" in r:
                print(f"torch.profiler, one {label} step (self CPU time):\n{r['profile']}")
    return results, runs


if __name__ == "__main__":  # the subprocess side of spawn
    parser = argparse.ArgumentParser(prog="lorafuse.bench.image")
    parser.add_argument("--worker", required=True, help="JSON run spec (internal)")
    raise SystemExit(worker_entry(parser.parse_args().worker, run_worker))
