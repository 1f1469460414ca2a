"""``lorafuse bench``: training speed of stock transformers + PEFT vs lorafuse, in one run.

The measurement protocol (fresh subprocess per run, interleaved, warmup excluded, peak memory) is
described in :mod:`lorafuse.bench`; this module parses the flags and prints the table.
``--task sd15|sdxl`` runs the UNet LoRA comparison of :mod:`lorafuse.bench.image` instead,
``--task vlm`` the vision-language one of :mod:`lorafuse.bench.vision`.
"""

from __future__ import annotations

import argparse

from lorafuse.bench import CONFIGS, MODELS, NF4, QUANTIZED, compare, format_table, write_json
from lorafuse.bench.config import FAMILY_MODELS, MOE_MODELS
from lorafuse.bench.report import batches_line, machine_line
from lorafuse.errors import LorafuseError


# fmt: off
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, default="llama-4l-1024",
                   help="llama-4l-1024: 4 layers, hidden 1024, 16 heads, intermediate 2816, vocab "
                        "32000; smollm2-135m: the SmolLM2-135M architecture (random weights); "
                        "llama-3.2-1b: the Llama-3.2-1B architecture (random weights, tied "
                        "embeddings, llama3 rope); tiny: 2 layers, hidden 64 (smoke tests); "
                        "qwen3.5-0.8b, gemma4-e2b: the Qwen3.5-0.8B and Gemma-4-E2B text "
                        "architectures, qwen3-0.8b-dense: Qwen3 with Qwen3.5-0.8B's widths "
                        "(random weights, LoRA on every Linear, no roofline)")
    p.add_argument("--layers", type=int, default=None,
                   help="qwen3.5-0.8b / qwen3-0.8b-dense / gemma4-e2b: their first N layers "
                        "(the layer pattern kept)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=None, help="default 4 (llm), 1 (sd15/sdxl)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="measured steps per repeat")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per repeat")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank on all seven projections")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in both")
    p.add_argument("--backend", default=None, help="lorafuse kernels: auto|torch|cpp|triton")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each run")
    p.add_argument("--quant", choices=("none", "nf4"), default="none",
                   help="nf4: also run lorafuse-nf4 (base linears in 4 bit, as load_in_4bit=True) "
                        "and lorafuse-nf4+emb (embeddings and lm_head too, quantize_embeddings=True) "
                        "and print their tokens/s and peak memory (weights included) vs lorafuse")
    p.add_argument("--use-dora", action="store_true",
                   help="DoRA adapters (PEFT's use_dora=True) in both: stock PEFT DoRA vs fused "
                        "DoRA (no roofline: its products are a plain LoRA step's)")
    p.add_argument("--only", choices=CONFIGS, default=None, help="run one configuration only")
    p.add_argument("--profile", action="store_true",
                   help="after measuring, profile one lorafuse step with torch.profiler")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="skip timing the unavoidable matrix products (roofline efficiency)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    p.add_argument("--compile", action="store_true",
                   help="also run stock and lorafuse under torch.compile (compiled during warmup)")
    p.add_argument("--method", choices=("sft", "dpo", "rm", "grpo", "rloo", "distill"),
                   default="sft",
                   help="dpo: TRL's DPOTrainer loss on stock PEFT vs lorafuse DPO; --batch pairs of "
                        "--seq tokens (half prompt), chosen + rejected in one batch. rm: TRL's "
                        "RewardTrainer on a PEFT sequence classifier vs lorafuse's reward model, "
                        "the same pairs. grpo / rloo: TRL's GRPOTrainer / RLOOTrainer (generation "
                        "+ update) vs lorafuse's; --batch prompts of --seq tokens, "
                        "--num-generations completions of --completion-length tokens. "
                        "distill: TRL's DistillationTrainer loss vs lorafuse's, a second model as "
                        "teacher; --batch rows of --seq tokens (half completion)")
    p.add_argument("--num-generations", type=int, default=4,
                   help="grpo, rloo: completions per prompt")
    p.add_argument("--completion-length", type=int, default=64,
                   help="grpo, rloo: tokens per completion (both sides generate exactly this many)")
    p.add_argument("--task", choices=("llm", "sd15", "sdxl", "vlm"), default="llm",
                   help="sd15/sdxl: UNet LoRA training step (random-weight SD1.5 / SDXL base UNet): "
                        "no LoRA vs kohya's unfused LoRA vs PEFT on diffusers vs lorafuse, at "
                        "--ranks; uses --batch --steps --warmup --repeats --dtype --device "
                        "--backend --threads --profile --json; vlm: image+text LoRA steps, stock "
                        "PEFT vs lorafuse, on --vlm; uses --batch --steps --warmup --repeats "
                        "--rank --grad-ckpt --dtype --device --threads --json")
    p.add_argument("--vlm", default="qwen2_vl",
                   help="vlm: idefics3 | qwen2_vl | qwen2_5_vl (random weights, --vlm-size) or "
                        "a local vision-language model dir")
    p.add_argument("--vlm-size", choices=("tiny", "small"), default="small",
                   help="vlm: built-in shape: small = 512-wide, 4 text + 4 vision layers")
    p.add_argument("--image-px", type=int, default=224, help="vlm: side of each square image")
    p.add_argument("--finetune-vision", action="store_true",
                   help="vlm: LoRA on the vision tower too (both sides)")
    p.add_argument("--resolution", type=int, default=256,
                   help="sd15/sdxl: image side in px (latents are resolution/8)")
    p.add_argument("--ranks", default="8,32,128", help="sd15/sdxl: LoRA ranks, comma-separated")
    p.add_argument("--configs", default="none,kohya,peft,lorafuse",
                   help="sd15/sdxl: configurations to run, comma-separated (none, the reference, "
                        "always runs)")
    p.add_argument("--unet-config", default=None, metavar="PATH",
                   help="sd15/sdxl: a UNet config.json (or a diffusers model dir) instead of the "
                        "built-in SD1.5 / SDXL base architecture")
# fmt: on


def _run_image(args) -> int:
    """``--task sd15|sdxl``: the UNet LoRA comparison of :mod:`lorafuse.bench.image`."""
    from lorafuse.bench import image as image_bench

    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        raise LorafuseError(
            f"--ranks must be comma-separated integers, got {args.ranks!r}"
        ) from None
    if not ranks or min(ranks) < 1:
        raise LorafuseError(f"--ranks must list ranks >= 1, got {args.ranks!r}")
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    unknown = sorted(set(configs) - set(image_bench.CONFIGS))
    if unknown:
        raise LorafuseError(
            f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(image_bench.CONFIGS)}"
        )
    if args.resolution < 64 or args.resolution % 64:
        raise LorafuseError(f"--resolution must be a multiple of 64, got {args.resolution}")
    spec = {"task": args.task, "unet_config": image_bench.unet_config(args.task, args.unet_config),
            "resolution": args.resolution, **{k: getattr(args, k) for k in (
                "dtype", "device", "batch", "steps", "warmup", "backend", "threads")}}  # fmt: skip
    image_bench.run(spec, ranks, args.repeats, profile=args.profile, json_path=args.json,
                    configs=configs)  # fmt: skip
    return 0


def _run_vision(args) -> int:
    from lorafuse.bench import vision

    spec = {"vlm": args.vlm, "size": args.vlm_size, "dtype": args.dtype,
            "device": args.device, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup, "rank": args.rank, "grad_ckpt": args.grad_ckpt,
            "threads": args.threads, "image_px": args.image_px,
            "finetune_vision": args.finetune_vision}  # fmt: skip
    vision.run(spec, args.repeats, json_path=args.json)
    return 0


def _validate(args) -> None:
    for name in (
        "batch",
        "seq",
        "steps",
        "repeats",
        "rank",
        "num_generations",
        "completion_length",
    ):
        if getattr(args, name) < 1:
            raise LorafuseError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise LorafuseError(f"--warmup must be >= 0, got {args.warmup}")
    if args.compile and (args.method != "sft" or args.task != "llm"):
        raise LorafuseError(
            "--compile measures LLM SFT steps only (not --method dpo or --task sd*)"
        )
    if args.quant != "none" and (args.compile or args.method != "sft" or args.task != "llm"):
        raise LorafuseError(
            "--quant nf4 measures eager LLM SFT steps only (no --compile, "
            "--method dpo or --task sd*)"
        )
    if args.use_dora and (args.compile or args.method != "sft" or args.task != "llm"):
        raise LorafuseError(
            "--use-dora measures eager LLM SFT steps only (no --compile, --method dpo or --task sd*)"
        )
    if args.model in MOE_MODELS and (args.method != "sft" or args.task != "llm"):
        raise LorafuseError(f"--model {args.model} measures LLM SFT steps only (no --method dpo)")
    if args.layers is not None and (args.layers < 1 or args.model not in FAMILY_MODELS):
        raise LorafuseError(
            f"--layers takes N >= 1 with --model {' / '.join(FAMILY_MODELS)}, got {args.layers} "
            f"with {args.model}"
        )
    if args.compile and args.warmup < 1:
        raise LorafuseError("--compile needs --warmup >= 1 (the compile happens in warmup)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise LorafuseError("--device cuda: no CUDA device is available here")


def run(args: argparse.Namespace) -> int:
    if args.batch is None:
        args.batch = 4 if args.task == "llm" else 1
    _validate(args)
    if args.task == "vlm":
        return _run_vision(args)
    if args.task != "llm":
        return _run_image(args)
    from lorafuse import backends

    spec = {k: getattr(args, k) for k in ("model", "dtype", "device", "batch", "seq", "steps",
                                          "warmup", "rank", "grad_ckpt", "backend", "threads")}  # fmt: skip
    if args.layers is not None:
        spec["layers"] = args.layers
    if args.model in FAMILY_MODELS:  # the roofline counts a Llama layer's products only
        args.roofline = False
    if args.quant != "none":
        spec["quant"] = args.quant
    if args.model in MOE_MODELS:  # the roofline's products are a dense Llama step's
        args.roofline = False
    if args.use_dora:  # the roofline's products are a LoRA step's; DoRA adds the weight norm
        spec["use_dora"] = True
        args.roofline = False
    if args.method != "sft":  # the roofline's products are an SFT step's; a DPO step has more
        spec["method"] = args.method
        args.roofline = False
    if args.method in ("grpo", "rloo"):
        spec.update(num_generations=args.num_generations, completion_length=args.completion_length)
    results, runs = compare(
        spec, args.repeats, only=args.only, profile=args.profile, roofline=args.roofline,
        compile=args.compile,
    )  # fmt: skip
    print(format_table(results, spec))
    for line in (machine_line(runs), batches_line(runs)):
        if line:
            print(line)
    if "lorafuse" in runs:
        print(runs["lorafuse"][-1]["report"])
    for name in QUANTIZED:
        if name in runs:
            print(f"{name}: {runs[name][-1]['report']}")
    for r in runs.get("lorafuse", []) + runs.get(NF4, []):
        if "profile" in r:
            print("torch.profiler, one lorafuse step (self CPU time):")
            print(r["profile"])
    if args.json:
        meta = {"spec": spec, "backends": backends.describe(), "runs": runs}
        write_json(args.json, {**results, **meta})
    return 0
