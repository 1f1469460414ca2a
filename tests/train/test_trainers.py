"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` (1.x) run a patched model as they run stock.

A tiny Llama (the tiny byte-level BPE chat tokenizer of ``lorafuse.testing``) first memorises
the chats in fp32, so it sits where a real pretrained model sits: its bf16 errors come from
rounding that stock and fused share, not from noise around a random model. Then LoRA r=8 trains
3 steps (batch 4) under each trainer, stock and patched from the same seed:

* fp32: every step's loss equals stock's within 1e-5 relative (padded batches; TRL's padded,
  packing and padding-free batches); TRL's entropy / token-accuracy metrics equal stock's.
* ``bf16=True`` (TRL's default; ``torch.autocast(bfloat16)`` on CPU): no crash for q/v-only or
  all-linear LoRA, and every step's loss is at most 1.5x as far from the fp32 run's as stock's
  is, or within the bf16 noise stock's own loss shows (see ``_autocast_bound``).
* With labels under autograd the patched model returns ``logits=None``; TRL 1.x never reads them
  (it passes ``fused_lm_head=True`` and scores with its own chunked head on our backbone), and
  evaluation / ``predict`` run under no_grad, where logits are returned as usual.
"""

from __future__ import annotations

import copy
import random

import datasets
import peft
import pytest
import torch
import trl

from lorafuse import patch_peft_model
from lorafuse.testing import single_thread, tiny_llama_config

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QV = ["q_proj", "v_proj"]
WORDS = (
    "the quick brown fox jumps over lazy dog what is capital of France Paris hello world".split()
)
KINDS = ["trainer", "sft", "sft_packing"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from single_thread()  # module-wide: the module fixtures below train a model too


def _chats(n=16, seed=0):
    rng = random.Random(seed)

    def say(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [
        {"messages": [{"role": "user", "content": say(2, 12)},
                      {"role": "assistant", "content": say(1, 10)}]}
        for _ in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    """(tokenizer, chats, token ids, memorised tiny base model)."""
    from transformers import LlamaForCausalLM

    from lorafuse.testing import chat_tokenizer

    tok = chat_tokenizer()
    chats = _chats()
    ids = [tok(tok.apply_chat_template(c["messages"], tokenize=False))["input_ids"] for c in chats]
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    base = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
    for step in range(150):
        opt.zero_grad()
        base(**_padded(ids[(step % 2) * 8 : (step % 2) * 8 + 8], tok.pad_token_id)).loss.backward()
        opt.step()
    return tok, chats, ids, base


def _padded(seqs, pad_id):
    ids = torch.full((len(seqs), max(map(len, seqs))), pad_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


# The LoRA A init, the same for stock and patched (benchmarks/probes/autocast_loss_noise.py
# varies it).
LORA_SEED = 1


def _lora(base, targets, patched):
    torch.manual_seed(LORA_SEED)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=8, lora_alpha=16,
                                                                     target_modules=targets))  # fmt: skip
    return patch_peft_model(model) if patched else model


class _Recording:
    """Records each step's loss at full precision (the logged values are rounded)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append((loss[0] if return_outputs else loss).item())
        return loss


def _train(setup, kind, targets, *, patched, bf16, patch_after=False, optim="adamw_torch", lr=1e-3):
    """Losses per step and TRL's logged metrics for one 3-step run."""
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tok, chats, ids, base = setup
    model = _lora(base, targets, patched and not patch_after)
    common = dict(output_dir="unused", max_steps=3, per_device_train_batch_size=4,
                  learning_rate=lr, optim=optim, logging_steps=1, report_to="none", use_cpu=True,
                  save_strategy="no", disable_tqdm=True, seed=0, bf16=bf16)  # fmt: skip
    if kind == "trainer":
        cls = type("RecordingTrainer", (_Recording, Trainer), {})
        data = datasets.Dataset.from_list([{"input_ids": x, "labels": x} for x in ids])
        trainer = cls(model=model, args=TrainingArguments(**common), train_dataset=data,
                      data_collator=DataCollatorForSeq2Seq(tok, padding=True))  # fmt: skip
    else:
        cls = type("RecordingSFTTrainer", (_Recording, trl.SFTTrainer), {})
        args = trl.SFTConfig(packing=kind == "sft_packing", max_length=64, **common)
        trainer = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(chats),
                      processing_class=tok)  # fmt: skip
    if patch_after:
        patch_peft_model(trainer.model)
    trainer.losses = []
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    metrics = [(h.get("entropy"), h.get("mean_token_accuracy")) for h in logged]
    return trainer.losses, metrics, trainer


@pytest.mark.parametrize("targets", [QV, ALL7], ids=["q_v", "all7"])
@pytest.mark.parametrize("kind", KINDS)
def test_fp32_losses_and_metrics_match_stock(setup, kind, targets):
    stock, stock_metrics, _ = _train(setup, kind, targets, patched=False, bf16=False)
    ours, our_metrics, _ = _train(setup, kind, targets, patched=True, bf16=False)
    assert len(ours) == len(stock) == 3
    for step, (a, b) in enumerate(zip(ours, stock)):
        # fp32: the fused ops reorder sums only (measured <= 6.4e-7 relative over 3 steps).
        assert abs(a - b) <= 1e-5 * abs(b), f"{kind} step {step}: ours {a} vs stock {b}"
    if kind != "trainer":  # TRL's own metrics, computed by its fused head on our backbone
        for (e, acc), (e0, acc0) in zip(our_metrics, stock_metrics):
            assert e is not None and acc is not None
            assert abs(e - e0) <= 1e-4 * abs(e0) and abs(acc - acc0) <= 1e-6


def test_patching_after_sft_trainer_is_built_defers_to_trls_head(setup):
    """Our causal-LM forward then wraps TRL's: ``fused_lm_head=True`` must still reach TRL."""
    stock, _, _ = _train(setup, "sft", QV, patched=False, bf16=False)
    ours, metrics, _ = _train(setup, "sft", QV, patched=True, bf16=False, patch_after=True)
    assert all(m[0] is not None for m in metrics)
    for a, b in zip(ours, stock):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, stock)


# The floor of _autocast_bound, relative to the fp32 loss: the bf16 noise of these runs' losses.
# `python benchmarks/probes/autocast_loss_noise.py` (8 LoRA seeds x 3 cases x 3 steps, 2-core AMD
# EPYC with AVX-512-BF16) measured stock's own distance from fp32 up to 1.31 x 2^-8 (5 of 72 steps
# above 2^-8, the floor until session 16), lorafuse's up to 1.30 x 2^-8 on the emulated branch at
# an RMS below stock's (1.04e-4 against 1.40e-4). So 2^-8 sat inside the noise, where stock
# itself would fail the bound; 2^-7 sits above it.
AUTOCAST_FLOOR = 2.0**-7


def _autocast_bound(stock, fp32):
    """How far from the fp32 loss the fused run may be: 1.5x stock's distance, or the bf16 noise
    of the loss itself (:data:`AUTOCAST_FLOOR` relative), whichever is larger.

    Why the floor: on a model this small a bf16 loss differs from fp32 by ~1e-4 (0.2%), rounding
    noise that flips sign with any change in operation order (two stock runs with rows permuted
    differ by as much); measured ratios ours/stock over 18 steps ranged 0.5-54 with stock's own
    distance as small as 3e-6. Below the floor the distance says nothing about accuracy; above it
    the 1.5x rule applies as written.
    """
    return max(1.5 * abs(stock - fp32), AUTOCAST_FLOOR * abs(fp32))


@pytest.mark.parametrize("targets", [QV, ALL7], ids=["q_v", "all7"])
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_bf16_runs_and_is_no_less_accurate(setup, kind, targets):
    # SGD, not AdamW: Adam's first step is lr * sign(grad), which turns bf16 rounding noise in
    # near-zero gradient entries into full-size opposite updates, so from step 2 on the runs
    # would compare Adam's noise amplification rather than the ops' accuracy (the model-level
    # gradients are compared in tests/patching/test_autocast.py).
    opt = dict(optim="sgd", lr=0.5)
    fp32, _, _ = _train(setup, kind, targets, patched=False, bf16=False, **opt)
    stock, _, _ = _train(setup, kind, targets, patched=False, bf16=True, **opt)
    ours, metrics, _ = _train(setup, kind, targets, patched=True, bf16=True, **opt)
    assert stock != fp32, "bf16=True did not change stock's numbers: autocast is not on"
    if kind != "trainer":
        assert all(e is not None and acc is not None for e, acc in metrics)
    for step, (a, s, r) in enumerate(zip(ours, stock, fp32)):
        assert abs(a - r) <= _autocast_bound(s, r), (
            f"{kind} step {step}: ours {a} stock {s} fp32 {r}"
        )


def test_trainer_predict_gets_logits_from_the_patched_model(setup):
    tok, _, ids, _ = setup
    _, _, trainer = _train(setup, "trainer", QV, patched=True, bf16=False)
    data = datasets.Dataset.from_list([{"input_ids": x, "labels": x} for x in ids[:4]])
    out = trainer.predict(data)
    assert out.predictions is not None and out.predictions.shape[-1] == len(tok)
