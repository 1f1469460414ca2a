"""First-step loss of SmolLM2-135M (fp32 weights) + LoRA r=8 (B=0) on 4 demo chat rows:
fp32, stock under autocast(bf16), lorafuse under autocast(bf16)."""

import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafuse import patch_peft_model
from lorafuse.data.demo_task import DEMO_DIR
from lorafuse.models.source import resolve_model_source

src = resolve_model_source(None)
tok = AutoTokenizer.from_pretrained(src)
rows = [json.loads(line) for line in open(f"{DEMO_DIR}/train.jsonl")][:4]
texts = [
    tok.apply_chat_template(
        r["messages"] + [{"role": "assistant", "content": r["answer"]}], tokenize=False
    )
    for r in rows
]
tok.pad_token = tok.pad_token or tok.eos_token
enc = tok(texts, return_tensors="pt", padding=True)
labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)


def model(patched):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    m = get_peft_model(
        base,
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        ),
    )
    return patch_peft_model(m, verbose=False) if patched else m


def loss(m, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = m(**enc, labels=labels)
    return out.loss.item()


stock, ours = model(False), model(True)
f32 = loss(stock, False)
print(f"fp32 stock {f32:.4f}  fp32 lorafuse {loss(ours, False):.4f}")
s, o = loss(stock, True), loss(ours, True)
print(
    f"autocast bf16: stock {s:.4f} (|d| {abs(s - f32):.4f})  lorafuse {o:.4f} (|d| {abs(o - f32):.4f})"
)
