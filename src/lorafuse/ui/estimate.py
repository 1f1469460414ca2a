"""Peak memory and tokens/s of a run before it starts: a small cost model fitted to measurements.

Shapes from the model's ``config.json`` (no weights loaded): weights, LoRA (16 bytes a
parameter), activations ``T * L * H * a`` (``a`` measured), a process overhead and load factor
(``CPU_RUNS``); tokens/s = effective FLOP/s (the median of measured runs of the closest size on
this kind of device, this workspace's runs included) / FLOPs per token. ``basis`` says which case
applied. The formulas: docs/ui.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

from lorafuse.models.memory import ACT_PER_TOKEN_LAYER_HIDDEN, auto_choice
from lorafuse.train.config import TrainConfig
from lorafuse.ui.errors import BadRequest

MB = 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NF4_BYTES = 0.5 + 4 / 64  # packed 4-bit weight + an fp32 absmax per 64-weight block
LORA_BYTES = 16  # fp32 weight + gradient + two AdamW moments
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# `lorafuse train --data src/lorafuse/data/demo/train.jsonl --batch-size B --max-seq-length S
#  --max-steps 4 --save-steps 0` (defaults: built-in SmolLM2-135M, bf16 on this AVX-512-BF16 CPU, gradient
# checkpointing, r=16 on all linears), last logging.jsonl record, 2 shared cores; and the tiny test
# Llama (lorafuse.testing.save_tiny_model) for the process overhead.
CPU_RUNS = [
    {"model": None, "batch": 1, "seq": 256, "dtype": "bfloat16", "tokens_per_s": 152.2, "peak_mem_mb": 1260.3},
    {"model": None, "batch": 1, "seq": 512, "dtype": "bfloat16", "tokens_per_s": 241.3, "peak_mem_mb": 1260.3},
    {"model": None, "batch": 2, "seq": 512, "dtype": "bfloat16", "tokens_per_s": 27.2, "peak_mem_mb": 1260.4},
]  # fmt: skip
CPU_OVERHEAD_MB = 490.0  # tiny Llama run: peak_mem_mb 495 with < 1 MB of weights
LOAD_FACTOR = 3.0  # SmolLM2 bf16: (1260 - 490) MiB of load peak over 256.5 MiB of weights


@functools.lru_cache(maxsize=16)
def model_shape(model: str | None) -> dict:
    """Sizes of ``model`` read from its config.json (HF dir; GGUF through the converted cache)."""
    from lorafuse.models.source import resolve_model_source

    try:
        cfg = json.loads((Path(resolve_model_source(model)) / "config.json").read_text())
    except Exception as err:  # ModelSourceError, unreadable config
        raise BadRequest(f"model {model or 'default'}: cannot read its shape ({err})") from None
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    vocab = cfg["vocab_size"]
    dims = {"q_proj": (h, heads * head_dim), "k_proj": (h, kv * head_dim),
            "v_proj": (h, kv * head_dim), "o_proj": (heads * head_dim, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    linear = layers * sum(i * o for i, o in dims.values())
    tied = cfg.get("tie_word_embeddings", False)
    embed = vocab * h * (1 if tied else 2)
    return {"hidden": h, "layers": layers, "vocab": vocab, "dims": dims, "linear": linear,
            "embed": embed, "params": linear + embed, "matmul": linear + vocab * h}  # fmt: skip


def default_device() -> str:
    """``"cuda"`` or ``"cpu"``: :func:`lorafuse.hardware.default_device`, as training picks."""
    from lorafuse import hardware

    return hardware.default_device().type


def default_dtype(device: str) -> str:
    """The loader's choice: bf16 on CUDA and on CPUs with native bf16 products, else fp32."""
    import torch

    from lorafuse.hardware import native_low_precision_matmul

    if device.startswith("cuda") or native_low_precision_matmul("cpu", torch.bfloat16):
        return "bfloat16"
    return "float32"


def flops_per_token(shape: dict, seq: int, ckpt: bool) -> float:
    k = 4 + 2 * int(ckpt)
    return k * shape["matmul"] + k * shape["layers"] * seq * shape["hidden"]


def memory_parts(cfg: TrainConfig, shape: dict, device: str) -> dict:
    """MiB of weights, LoRA state and saved activations (no process overhead)."""
    b = DTYPE_BYTES[cfg.dtype or default_dtype(device)]
    embed_b = NF4_BYTES if cfg.load_in_4bit and cfg.quantize_embeddings else b
    weights = shape["embed"] * embed_b + shape["linear"] * (NF4_BYTES if cfg.load_in_4bit else b)
    targets = cfg.target_modules or ALL_TARGETS
    lora = sum(cfg.lora_r * (i + o) for name, (i, o) in shape["dims"].items() if name in targets)
    tokens = cfg.batch_size * cfg.max_seq_length
    act = (
        tokens
        * shape["layers"]
        * shape["hidden"]
        * ACT_PER_TOKEN_LAYER_HIDDEN[cfg.gradient_checkpointing]
        * b
        / 4
    )
    return {"weights": weights / MB, "lora": lora * shape["layers"] * LORA_BYTES / MB,
            "activations": act / MB}  # fmt: skip


def predicted_peak(cfg: TrainConfig, shape: dict, device: str, overhead: float) -> float:
    p = memory_parts(cfg, shape, device)
    resident = p["weights"] + p["lora"] + p["activations"]
    if device.startswith("cuda"):
        return resident + overhead
    return overhead + max(LOAD_FACTOR * p["weights"], resident)


def _point_config(point: dict) -> TrainConfig:
    return TrainConfig(model=point["model"], batch_size=point["batch"], max_seq_length=point["seq"],
                       dtype=point["dtype"], gradient_checkpointing=point.get("ckpt", True),
                       load_in_4bit=point.get("load_in_4bit", False))  # fmt: skip


def workspace_points(runs) -> list[dict]:
    """Measurements from this workspace's runs: config + median tokens/s + max peak_mem_mb."""
    points = []
    for run in runs.list():
        records = [r for r in runs.records(run["id"]) if "tokens_per_s" in r]
        if len(records) < 2:
            continue
        cfg = runs.view(run["id"], with_config=True)["config"]
        device = cfg.get("device") or default_device()
        points.append({
            "model": cfg.get("model"), "batch": cfg.get("batch_size", 1),
            "seq": cfg.get("max_seq_length", 2048), "dtype": cfg.get("dtype") or default_dtype(device),
            "ckpt": cfg.get("gradient_checkpointing", True) is not False, "load_in_4bit": cfg.get("load_in_4bit", False),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[1:]),
            "peak_mem_mb": max(r["peak_mem_mb"] for r in records), "device": device,
            "run": run["id"],
        })  # fmt: skip
    return points


def estimate(cfg: TrainConfig, runs=None) -> dict:
    """{peak_mem_mb, tokens_per_s (or None), free_mem_mb, fits, basis} for ``cfg``; checkpointing
    left to the trainer (None) is decided as the trainer decides it (``auto_choice``)."""
    device = cfg.device or default_device()
    kind = "cuda" if device.startswith("cuda") else "cpu"
    shape = model_shape(cfg.model)
    if cfg.gradient_checkpointing is None:
        config = SimpleNamespace(num_hidden_layers=shape["layers"], hidden_size=shape["hidden"])
        itemsize = DTYPE_BYTES[cfg.dtype or default_dtype(device)]
        on, _ = auto_choice(config, cfg.batch_size * cfg.max_seq_length, itemsize,
                            int(free_memory_mb(device) * MB))  # fmt: skip
        cfg = dataclasses.replace(cfg, gradient_checkpointing=on)
    points = [dict(p, device="cpu") for p in CPU_RUNS] + (workspace_points(runs) if runs else [])
    points = [p for p in points if p["device"].split(":")[0] == kind]
    rates, gaps, sizes = [], [], []
    for p in points:
        try:
            pshape = model_shape(p["model"])
        except BadRequest:
            continue  # a run whose model is gone: its measurement cannot be scaled
        pcfg = _point_config(p)
        rates.append(
            p["tokens_per_s"] * flops_per_token(pshape, p["seq"], pcfg.gradient_checkpointing)
        )
        gaps.append(p["peak_mem_mb"] - predicted_peak(pcfg, pshape, p["device"], 0.0))
        sizes.append(abs(math.log(pshape["params"] / shape["params"])))
    # FLOP rates only transfer between models of similar size (tiny models are overhead-bound):
    # use the measurements of the closest size (within 2x of it)
    closest = min(sizes, default=0.0)
    rates = [r for r, d in zip(rates, sizes) if d <= closest + math.log(2)]
    overhead = statistics.median(gaps) if gaps else (CPU_OVERHEAD_MB if kind == "cpu" else 0.0)
    overhead = max(0.0, overhead)
    peak = predicted_peak(cfg, shape, device, overhead)
    tok_s = None
    if rates:
        tok_s = statistics.median(rates) / flops_per_token(
            shape, cfg.max_seq_length, cfg.gradient_checkpointing
        )
    free = free_memory_mb(device)
    parts = memory_parts(cfg, shape, device)
    n_ws = sum(1 for p in points if "run" in p)
    basis = (
        f"{shape['params'] / 1e6:.0f}M parameters, {cfg.dtype or default_dtype(device)}"
        f"{', 4-bit' if cfg.load_in_4bit else ''} on {kind}: weights {parts['weights']:.0f} MiB + LoRA "
        f"state {parts['lora']:.0f} MiB + activations {parts['activations']:.0f} MiB for "
        f"{cfg.batch_size} x {cfg.max_seq_length} tokens + overhead {overhead:.0f} MiB; "
        f"throughput scaled by FLOPs per token from {len(rates)} measured run(s) of the closest "
        f"model size on {kind} ({n_ws} run(s) of this workspace measured)"
        + ("" if rates else "; no measurement on this kind of device yet, so no tokens/s")
    )
    return {"peak_mem_mb": round(peak, 1), "tokens_per_s": round(tok_s, 1) if tok_s else None,
            "free_mem_mb": round(free, 1), "fits": peak < free, "device": device,
            "parts_mb": {k: round(v, 1) for k, v in parts.items()} | {"overhead": round(overhead, 1)},
            "basis": basis}  # fmt: skip


def free_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free / MB
    import psutil

    return psutil.virtual_memory().available / MB
