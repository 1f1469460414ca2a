"""Preference-pair fixtures for the DPO / ORPO / SimPO / CPO / reward-model tests: chat pairs, a
stock PEFT model with a random non-zero LoRA and its patched copy, TRL's collation of pairs."""

from __future__ import annotations

import copy
import random

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def pair_records(n: int, seed: int = 0) -> list[dict]:
    """Chat pairs: the right sum against a wrong one, responses of different lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        wrong = a + b + rng.randint(1, 9)
        out.append({
            "prompt": [{"role": "user", "content": f"what is {a} and {b}"}],
            "chosen": [{"role": "assistant", "content": f"the answer is {a + b}"}],
            "rejected": [{"role": "assistant", "content": "the answer is " + f"{wrong} " * rng.randint(1, 3)}],
        })  # fmt: skip
    return out


def pair_models(model_dir: str, pair_file: str, n_pairs: int = 3):
    """``(tokenizer, pairs, stock PEFT model with random non-zero LoRA, patched deep copy)``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorafuse import patch_peft_model
    from lorafuse.data.dataset import DataSpec
    from lorafuse.data.preference import build_pairs

    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs = build_pairs(DataSpec(train_files=[pair_file], max_seq_length=64), tok).train[:n_pairs]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    stock = get_peft_model(base, lora)
    with torch.no_grad():  # policy far enough from the reference for every loss to matter
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.mul_(3.0)
    ours = patch_peft_model(copy.deepcopy(stock))
    return tok, pairs, stock, ours


def trl_pair_batch(pairs, pad_id: int) -> dict[str, torch.Tensor]:
    """TRL's DPO collation of the same pairs: [chosen..., rejected...], completion_mask."""
    from torch.nn.utils.rnn import pad_sequence

    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    pad = lambda xs, v: pad_sequence(xs, batch_first=True, padding_value=v)  # noqa: E731
    return {
        "input_ids": pad([torch.tensor(e.input_ids) for e in seqs], pad_id),
        "attention_mask": pad([torch.ones(len(e.input_ids), dtype=torch.long) for e in seqs], 0),
        "completion_mask": pad([torch.tensor([int(t != -100) for t in e.labels]) for e in seqs], 0),
    }


def lora_grads(model) -> dict[str, torch.Tensor]:
    """The gradients of ``model``'s parameters (cloned), then zeroed."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads
