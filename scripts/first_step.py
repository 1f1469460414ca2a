"""One LoRA training step through ``patch_peft_model`` on the tiny test Llama, as a new user's
first run: the time from process start to the end of the first optimizer step (the C++ kernels
are loaded, or compiled, on the way), what ran, and the step's numbers for comparing builds.

Usage: python scripts/first_step.py OUT_DIR   (scripts/wheel_check.sh runs it)
Writes OUT_DIR/status.json (wall and CPU seconds, backends.describe(), losses) and OUT_DIR/tensors.pt (each
dtype's loss and LoRA gradients); exits non-zero if a C++ kernel did not run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from lorafuse import backends, patch_peft_model
from lorafuse.testing import tiny_llama_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def first_step(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).to(dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    for name, p in model.named_parameters():  # PEFT's B starts at zero: no gradient reaches A
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    patch_peft_model(model, backend="cpp")  # the C++ kernels, never a silent torch fallback
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return {"loss": out.loss.detach(), **grads}  # logits: none (the fused loss skips them)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"float32": first_step(torch.float32)}
    seconds = time.time() - psutil.Process().create_time()  # the first step, from process start
    t = os.times()  # CPU time too, compilers (waited-for children) included: a busy machine's
    cpu_seconds = t.user + t.system + t.children_user + t.children_system  # wall time is noisy
    tensors["bfloat16"] = first_step(torch.bfloat16)
    described = backends.describe()
    status = {
        "seconds_to_first_step": round(seconds, 2),
        "cpu_seconds_to_first_step": round(cpu_seconds, 2),
        "describe": described,
        "loss": {k: v["loss"].float().item() for k, v in tensors.items()},
        "torch": torch.__version__,
        "lorafuse": str(Path(backends.__file__).parent),
    }
    torch.save(tensors, out / "tensors.pt")
    (out / "status.json").write_text(json.dumps(status, indent=1, default=str))
    print(json.dumps(status, default=str))
    ran = {op: why for op, why in described["choices"].items() if why.startswith("cpp")}
    if not described["cpp"] or not ran:
        print(f"FAIL: the C++ kernels did not run: {described['choices']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
