"""Measure what 4-bit loading and gradient checkpointing save (``python -m lorafuse.models.memory``).

* parameter + buffer bytes of the NF4 model vs the same model in bf16 (:func:`nf4.memory_report`);
* process RSS growth of loading the model in bf16 vs in 4 bit, each in a fresh subprocess
  (freed heap returned to the OS with ``malloc_trim`` before reading RSS);
* activation bytes kept for backward by one training forward, gradient checkpointing off / on
  (CPU: saved-tensor hooks; CUDA: also peak allocated memory, with ``"offload"``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys

import torch

# Saved activation bytes per token per layer per hidden unit (fp32) of one training forward,
# gradient checkpointing off / on: SmolLM2-135M, batch 1 x 256, lorafuse's fused paths, measured
# with activation_bytes(None, "cpu", 1, 256) (saved-tensor hooks): 216.8 MB and 18.9 MB. Other
# dtypes scale by their item size / 4. The web UI's estimate and the trainer's checkpointing
# choice (:func:`auto_choice`) read them.
ACT_PER_TOKEN_LAYER_HIDDEN = {False: 49.0, True: 4.27}


def activation_estimate(config, tokens: int, itemsize: int, checkpointing: bool) -> float:
    """Bytes one micro-batch of ``tokens`` tokens keeps for backward: tokens x layers x hidden x
    :data:`ACT_PER_TOKEN_LAYER_HIDDEN` x ``itemsize`` / 4 (``config``: a transformers config or
    its text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    per = ACT_PER_TOKEN_LAYER_HIDDEN[bool(checkpointing)] * itemsize / 4
    return tokens * text.num_hidden_layers * text.hidden_size * per


# Checkpointing is chosen on (when not set) where the activations one micro-batch keeps without
# it would take more than this share of the memory available when training starts: the rest is
# left for the weights' transients, the optimizer state, the allocator's slack and other
# processes. SmolLM2-135M at 2 x 256 fp32 keeps ~0.43 GB without it; a 24 GB machine keeps it off.
AUTO_SHARE = 0.5


def auto_choice(config, tokens: int, itemsize: int, available: int) -> tuple[bool, str]:
    """``(on, why)``: checkpointing for micro-batches of ``tokens`` tokens of a model with
    ``config`` in a dtype of ``itemsize`` bytes, given ``available`` bytes: on only where the
    estimated activations without it (:func:`activation_estimate`) exceed :data:`AUTO_SHARE`
    of them."""
    need = activation_estimate(config, tokens, itemsize, checkpointing=False)
    on = need > AUTO_SHARE * available
    verdict = "more" if on else "less"
    return on, (f"gradient checkpointing {'on' if on else 'off'}: activations of {tokens} tokens "
                f"estimated at {need / 2**30:.2f} GiB without it, {verdict} than "
                f"{AUTO_SHARE:.0%} of the {available / 2**30:.1f} GiB available")  # fmt: skip


def available_bytes(device) -> int:
    """Memory a run on ``device`` can still take: the kernel's ``MemAvailable`` (CPU; free
    physical pages where there is no /proc/meminfo) or the device's free memory (CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: RSS then includes freed-but-cached heap
        pass
    return psutil.Process().memory_info().rss


def _child(model: str | None, four_bit: bool, device: str) -> None:
    """Subprocess body: print the RSS growth of one load as JSON."""
    import transformers  # noqa: F401  (import cost is not the model's)

    from lorafuse import FastLanguageModel

    before = _rss()
    m, _ = FastLanguageModel.from_pretrained(
        model, dtype=torch.bfloat16, load_in_4bit=four_bit, device=device
    )
    cuda = torch.cuda.memory_allocated() if device == "cuda" else 0
    print(json.dumps({"rss": _rss() - before, "cuda_allocated": cuda}))


def memory_of_load(model: str | None, four_bit: bool, device: str) -> dict[str, int]:
    """RSS growth (and CUDA allocation) of one load, measured in a fresh interpreter."""
    code = f"from lorafuse.models.memory import _child; _child({model!r}, {four_bit}, {device!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def activation_bytes(model: str | None, device: str, batch: int, seq: int) -> dict[str, int]:
    from lorafuse import FastLanguageModel
    from lorafuse.models.grad_checkpointing import measure_activation_memory

    modes = [False, True] + (["offload"] if device == "cuda" else [])
    result = {}
    for mode in modes:
        base, _ = FastLanguageModel.from_pretrained(model, dtype=torch.float32, device=device)
        peft_model = FastLanguageModel.get_peft_model(base, r=16, use_gradient_checkpointing=mode)
        ids = torch.randint(0, base.config.vocab_size, (batch, seq), device=device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        result[f"saved_bytes[{mode}]"] = measure_activation_memory(peft_model, ids)
        if device == "cuda":
            result[f"cuda_peak_minus_start[{mode}]"] = torch.cuda.max_memory_allocated() - start
        del base, peft_model
        gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model dir / .gguf (default: built-in SmolLM2)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    from lorafuse import FastLanguageModel
    from lorafuse.models import nf4

    m4, _ = FastLanguageModel.from_pretrained(
        args.model, dtype=torch.bfloat16, load_in_4bit=True, device=args.device
    )
    report = {"bytes": nf4.memory_report(m4)}
    del m4
    bf16 = memory_of_load(args.model, False, args.device)
    q4 = memory_of_load(args.model, True, args.device)
    report["load"] = {"bf16": bf16, "nf4": q4, "rss_ratio": q4["rss"] / bf16["rss"]}
    if args.device == "cuda":
        report["load"]["cuda_ratio"] = q4["cuda_allocated"] / bf16["cuda_allocated"]
    report["activations"] = activation_bytes(args.model, args.device, args.batch, args.seq)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
