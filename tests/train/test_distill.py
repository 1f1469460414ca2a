"""Distillation: on the same prompts and completions, our loss and every LoRA gradient equal TRL's
``DistillationTrainer._compute_loss`` (its chunked divergence on the student's and teacher's final
hidden states) for forward KL, reverse KL and the generalized JSD, with a teacher model of another
width or the base itself (the adapter disabled; TRL: a copy of the base); ``lorafuse train --method
distill`` runs on- and off-policy steps and resumes bit for bit; the teacher's vocabulary and the
config are checked."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from lorafuse.data.packing import Row
from lorafuse.testing import assert_close
from lorafuse.testing.preference import TARGETS, lora_grads
from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.distill import DistillError, DistillObjective
from lorafuse.train.engine import train

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
PROMPT = 6
LENGTHS = [4, 7, 2, 5]  # completion lengths: right padding in one batch


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer, teacher dir, stock PEFT student, patched copy, TRL trainer, teacher models)."""
    from datasets import Dataset
    from peft import (
        LoraConfig,
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    from lorafuse import patch_peft_model
    from lorafuse.testing import save_tiny_model

    student_dir = tmp_path_factory.mktemp("student")
    teacher_dir = tmp_path_factory.mktemp("teacher")
    save_tiny_model(student_dir, scale=1.0)
    save_tiny_model(teacher_dir, seed=1, scale=3.0, hidden_size=96, intermediate_size=128)
    tok = AutoTokenizer.from_pretrained(student_dir)
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # noqa: E731
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    stock = get_peft_model(load(student_dir), lora)
    ours = patch_peft_model(copy.deepcopy(stock))
    args = DistillationConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[],
                              use_cpu=True, bf16=False, gradient_checkpointing=False,
                              max_completion_length=8)  # fmt: skip
    trainer = DistillationTrainer(model=load(student_dir), teacher_model=load(teacher_dir),
                                  args=args, train_dataset=Dataset.from_list([{"prompt": "hi"}]),
                                  processing_class=tok,
                                  peft_config=LoraConfig(r=4, lora_alpha=8,
                                                         target_modules=TARGETS))  # fmt: skip
    result = set_peft_model_state_dict(trainer.model, get_peft_model_state_dict(stock))
    assert not result.unexpected_keys
    trainer.model.train()
    teachers = {"dir": trainer.teacher_model, "base": load(student_dir).eval()}
    return tok, str(teacher_dir), stock, ours, trainer, teachers


def _batch(vocab: int, pad: int):
    """TRL's inputs (equal-length prompts: TRL left-pads them, we do not) and our rows."""
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, vocab, (len(LENGTHS), PROMPT), generator=g)
    comps = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    C = max(LENGTHS)
    ids = torch.full((len(LENGTHS), C), pad, dtype=torch.long)
    mask = torch.zeros((len(LENGTHS), C), dtype=torch.long)
    for i, c in enumerate(comps):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts),
              "completion_ids": ids, "completion_mask": mask}  # fmt: skip
    rows = [Row(p + c, [-100] * PROMPT + c, list(range(PROMPT + len(c))), 1)
            for p, c in zip(prompts.tolist(), comps)]  # fmt: skip
    return inputs, rows


@pytest.mark.parametrize("teacher", ["dir", "base"])
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (1.0, 1.0), (0.5, 1.0), (0.2, 0.8)])
def test_loss_and_grads_equal_trl(setup, teacher, beta, temperature):
    tok, teacher_dir, stock, ours, trl, teachers = setup
    trl.beta, trl.temperature = beta, temperature
    trl.teacher_model = teachers[teacher]
    inputs, rows = _batch(trl.model.config.vocab_size, tok.pad_token_id)
    n_items = inputs["completion_mask"].sum()
    ref_loss, _, _ = trl._compute_loss(trl.model, inputs, n_items)
    ref_loss.backward()
    ref_grads = lora_grads(trl.model)
    for name, model in (("stock", stock), ("lorafuse", ours)):
        obj = DistillObjective(beta, temperature, teacher_dir if teacher == "dir" else None,
                               tok.pad_token_id, tok, "cpu")  # fmt: skip
        obj.check(model)
        counts = obj.counts(rows)
        assert float(counts[0]) == float(n_items)
        loss, sums = obj.loss(model, rows, counts)
        loss.backward()
        grads = lora_grads(model)
        assert ref_loss.item() > 1e-3
        assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5, name=f"{name} loss")
        assert grads.keys() == ref_grads.keys() and grads
        for k in grads:
            scale = ref_grads[k].abs().max().item()
            assert scale > 0, k
            assert_close(grads[k], ref_grads[k], atol=1e-5 * scale, rtol=1e-5, name=k)
        assert obj.metrics(sums, counts)["entropy"] > 0


def test_teacher_vocabulary_is_checked(setup, tmp_path):
    from lorafuse.testing import save_tiny_model

    tok, _, _, ours, _, _ = setup
    other = tmp_path / "words"
    save_tiny_model(other, tokenizer="words", scale=1.0, vocab_size=len(tok))
    obj = DistillObjective(1.0, 1.0, str(other), tok.pad_token_id, tok, "cpu")
    with pytest.raises(DistillError, match="tokenizer differs"):
        obj.check(ours)
    obj = DistillObjective(1.0, 1.0, str(tmp_path / "nowhere"), tok.pad_token_id, tok, "cpu")
    with pytest.raises(DistillError, match="not a local model dir"):
        obj.check(ours)


# ---- the engine ------------------------------------------------------------------------------
def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def test_training_resumes_bit_for_bit(make_config, plain_model_dir, tmp_path):
    args = dict(method="distill", teacher=plain_model_dir, beta=0.5, lmbda=0.5, batch_size=2,
                grad_accum=2, max_steps=4, save_steps=2, max_completion_length=6,
                lr_scheduler="constant", num_threads=1)  # fmt: skip
    ref = train(make_config(output_dir=str(tmp_path / "ref"), **args))
    log = _log(tmp_path / "ref")
    assert {r["on_policy"] for r in log} == {0.0, 1.0}  # both kinds of step ran
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in log)
    assert "entropy" in log[0] and "completions/mean_length" in next(
        r for r in log if r["on_policy"]
    )
    resumed = train(make_config(output_dir=str(tmp_path / "res"),
                                resume=str(tmp_path / "ref" / "checkpoint-2"), **args))  # fmt: skip
    assert resumed["steps"] == ref["steps"] == 4
    assert resumed["train_loss"] == ref["train_loss"]  # bit-exact
    from safetensors.torch import load_file

    a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
    b = load_file(os.path.join(resumed["adapter"], "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_learns_the_teacher(make_config, plain_model_dir):
    """The divergence to a teacher falls (the student: scale-20 weights, the teacher: scale 1)."""
    cfg = make_config(method="distill", teacher=plain_model_dir, beta=0.0, batch_size=4,
                      max_steps=8, lr=1e-2, lr_scheduler="constant", num_threads=1,
                      eval_split=0.2)  # fmt: skip
    summary = train(cfg)
    losses = [r["loss"] for r in _log(cfg.output_dir)]
    assert sum(losses[-2:]) < 0.9 * sum(losses[:2]), losses
    assert summary["eval_loss"] > 0


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"beta": 1.5}, "beta"),
        ({"beta": -0.1}, "beta"),
        ({"lmbda": 2.0}, "lmbda"),
        ({"loss_type": "sigmoid"}, "loss_type"),
        ({"reward": ["exact"]}, "reward"),
        ({"temperature": 0.0}, "temperature"),
        ({"lmbda": 0.5, "max_completion_length": 4096}, "max_completion_length"),
        ({"train_on_inputs": True}, "train_on_inputs"),
    ],
)
def test_config_checks(kw, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{"method": "distill", **kw})
    assert TrainConfig(method="distill").beta == 1.0  # TRL's DistillationConfig default
    for method, extra in (("sft", {}), ("dpo", {}), ("grpo", {"reward": ["exact"]}),
                          ("rm", {})):  # fmt: skip
        with pytest.raises(ConfigError, match="teacher"):
            TrainConfig(method=method, teacher="t", **extra)
        with pytest.raises(ConfigError, match="lmbda"):
            TrainConfig(method=method, lmbda=0.5, **extra)
