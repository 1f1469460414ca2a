"""KTO: our loss and LoRA gradients equal TRL's ``KTOTrainer._compute_loss`` on the same batch and
weights (KL point from the mismatched pairs included); training runs from the CLI config and logs
TRL's metrics; resume is bit for bit; config checks."""

from __future__ import annotations

import copy
import json
import os
import random

import pytest
import torch

from lorafuse.data.dataset import DataSpec
from lorafuse.data.kto import build_kto
from lorafuse.testing import assert_close
from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.engine import train
from lorafuse.train.kto import KTOObjective, kl_rows

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def kto_records(n: int, seed: int = 0) -> list[dict]:
    """Chat records, right sums desirable and wrong ones not, completions of different lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        good = i % 3 != 0
        ans = a + b if good else a + b + rng.randint(1, 9)
        text = "the answer is " + f"{ans} " * rng.randint(1, 3)
        if i % 2:
            out.append(
                {
                    "prompt": [{"role": "user", "content": f"what is {a} and {b}"}],
                    "completion": [{"role": "assistant", "content": text}],
                    "label": good,
                }
            )
        else:
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": f"what is {a} and {b}"},
                        {"role": "assistant", "content": text},
                    ],
                    "label": good,
                }
            )
    return out  # fmt: skip


@pytest.fixture(scope="module")
def kto_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kto") / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in kto_records(24)))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, kto_file):
    """(tokenizer, rows, TRL KTOTrainer holding a stock PEFT model, patched copy of that model)."""
    from datasets import Dataset
    from peft import (
        LoraConfig,
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from lorafuse import patch_peft_model
    from lorafuse.testing import save_tiny_model

    model_dir = tmp_path_factory.mktemp("tiny_plain")
    save_tiny_model(model_dir, scale=1.0)  # moderate logits: the test measures the loss
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = build_kto(DataSpec(train_files=[kto_file], max_seq_length=64), tok).train[:5]
    assert {r.label for r in rows} == {True, False}
    args = KTOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), beta=0.1, report_to=[],
                     use_cpu=True, bf16=False, gradient_checkpointing=False)  # fmt: skip
    ds = Dataset.from_list([{"prompt": "a", "completion": " b", "label": True},
                            {"prompt": "c", "completion": " d", "label": False}])  # fmt: skip
    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # noqa: E731
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    stock = get_peft_model(load(), lora)
    with torch.no_grad():  # policy far enough from the reference for the KL point to be > 0
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.mul_(3.0)
    ours = patch_peft_model(copy.deepcopy(stock))
    # TRL builds its PEFT model itself (it patches the model's head); same LoRA weights loaded in
    trainer = KTOTrainer(model=load(), args=args, train_dataset=ds, processing_class=tok,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))  # fmt: skip
    result = set_peft_model_state_dict(trainer.model, get_peft_model_state_dict(stock))
    assert not result.unexpected_keys
    return tok, rows, trainer, ours, stock


def _trl_batch(rows, pad_id):
    """TRL's unpaired collation of the same records and of their mismatched (KL) pairs."""
    from torch.nn.utils.rnn import pad_sequence

    pad = lambda xs, v: pad_sequence(xs, batch_first=True, padding_value=v)  # noqa: E731

    def three(seqs, prefix=""):
        return {
            f"{prefix}input_ids": pad([torch.tensor(i) for i, _ in seqs], pad_id),
            f"{prefix}attention_mask": pad([torch.ones(len(i), dtype=torch.long) for i, _ in seqs], 0),
            f"{prefix}completion_mask": pad([torch.tensor([int(t != -100) for t in lab])
                                             for _, lab in seqs], 0),
        }  # fmt: skip

    batch = three([(r.enc.input_ids, r.enc.labels) for r in rows])
    batch.update(three(kl_rows(rows), "KL_"))
    batch["label"] = torch.tensor([r.label for r in rows])
    return batch


def _lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n.replace(".default", ""): p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("beta, wd, wu", [(0.1, 1.0, 1.0), (0.5, 1.33, 0.7)])
def test_kto_loss_and_grads_equal_trl(models, beta, wd, wu):
    tok, rows, trl, ours, stock = models
    trl.beta, trl.desirable_weight, trl.undesirable_weight = beta, wd, wu
    trl._metrics["train"].clear()
    batch = _trl_batch(rows, tok.pad_token_id)
    ref_loss = trl._compute_loss(trl.model, batch, False)
    ref_loss.backward()
    ref_grads = _lora_grads(trl.model)
    trl_kl = trl._metrics["train"]["kl"][-1]
    truth_model = copy.deepcopy(trl.model).double()  # the oracle: TRL's math in fp64
    trl._compute_loss(truth_model, {k: v.double() if v.is_floating_point() else v
                                    for k, v in batch.items()}, False).backward()  # fmt: skip
    truth = _lora_grads(truth_model)
    obj = KTOObjective(beta, wd, wu, tok.pad_token_id, torch.device("cpu"))
    counts = obj.counts(rows)
    # 1) our objective on the stock PEFT model: TRL's math exactly (fp32, 1e-5)
    stock_loss, _ = obj.loss(stock, rows, counts)
    stock_loss.backward()
    stock_grads = _lora_grads(stock)
    assert_close(stock_loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5, name="loss")
    assert stock_grads.keys() == ref_grads.keys() and stock_grads
    for k in stock_grads:
        scale = ref_grads[k].abs().max().item()
        assert_close(stock_grads[k], ref_grads[k], atol=1e-5 * scale, rtol=1e-5, name=k)
    # 2) on the fused (patched) model
    loss, sums = obj.loss(ours, rows, counts)
    loss.backward()
    grads = _lora_grads(ours)
    metrics = obj.metrics(sums, counts)
    assert trl_kl > 1e-3, trl_kl  # the KL point is active: its estimate is tested
    assert metrics["kl"] == pytest.approx(trl_kl, rel=1e-5, abs=1e-6)
    assert metrics["rewards/chosen"] == pytest.approx(
        trl._metrics["train"]["rewards/chosen"][-1], rel=1e-4, abs=1e-6
    )
    assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5, name="loss")
    assert grads.keys() == ref_grads.keys() and grads
    worst = {"stock": 0.0, "lorafuse": 0.0}
    for k in grads:  # each gradient against TRL's in fp64, relative to the gradient's scale
        t = truth[k].double()
        scale = t.abs().max().item()
        for name, g in (("stock", ref_grads[k]), ("lorafuse", grads[k])):
            worst[name] = max(worst[name], (g.double() - t).abs().max().item() / scale)
    # As DPO's test (test_preference._compare): desirable and undesirable records push opposite
    # ways through shared prompt rows, so fp32 rounding is amplified; kernels that block by row
    # position (ours) round the rows differently from stock. Measured (AVX-512-BF16/AMX CPU): stock
    # 2.2e-5 of the gradient's scale from fp64, ours 4.3e-5; a wrong gradient is off by ~1e-1.
    assert worst["stock"] < 5e-5 and worst["lorafuse"] < 5e-5, worst


def test_padding_rows_change_nothing(models):
    tok, rows, _, ours, _ = models
    obj = KTOObjective(0.1, 1.0, 1.0, tok.pad_token_id, torch.device("cpu"))
    a, _ = obj.loss(ours, rows, obj.counts(rows))
    padded = rows + [rows[0].zeroed()]
    b, _ = obj.loss(ours, padded, obj.counts(padded))
    assert_close(b.detach(), a.detach(), atol=1e-6, rtol=1e-6, name="loss")


# ---- the engine ------------------------------------------------------------------------------
@pytest.fixture
def kto_config(tiny_model_dir, kto_file, tmp_path):
    def make(**kw):
        base = dict(model=tiny_model_dir, data=[kto_file], output_dir=str(tmp_path / "out"),
                    max_seq_length=64, gradient_checkpointing=False, progress=False, save_steps=0,
                    lr=2e-3, dtype="float32", device="cpu", method="kto", beta=0.5,
                    lr_scheduler="constant", num_threads=1)  # fmt: skip
        base.update(kw)
        return TrainConfig(**base)

    return make


def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def test_training_separates_the_rewards(kto_config):
    cfg = kto_config(batch_size=4, max_steps=6)
    train(cfg)
    log = _log(cfg.output_dir)
    assert {"loss", "kl", "rewards/chosen", "logps/chosen", "tokens_per_s"} <= log[0].keys()
    margins = [r["rewards/margins"] for r in log if "rewards/margins" in r]
    assert len(margins) >= 2 and margins[-1] > margins[0], margins
    assert log[-1]["loss"] < log[0]["loss"]


def test_resume_is_bit_for_bit(kto_config, tmp_path):
    args = dict(batch_size=2, grad_accum=2, max_steps=4, save_steps=2, lora_dropout=0.1)
    ref = train(kto_config(output_dir=str(tmp_path / "ref"), **args))
    resumed = train(kto_config(output_dir=str(tmp_path / "res"),
                               resume=str(tmp_path / "ref" / "checkpoint-2"), **args))  # fmt: skip
    assert resumed["steps"] == ref["steps"] == 4
    assert resumed["train_loss"] == ref["train_loss"]  # bit-exact, not approximately
    from safetensors.torch import load_file

    a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
    b = load_file(os.path.join(resumed["adapter"], "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"method": "kto", "desirable_weight": 0.0}, "desirable_weight"),
        ({"method": "kto", "undesirable_weight": -1.0}, "undesirable_weight"),
        ({"method": "kto", "train_on_inputs": True}, "train_on_inputs"),
    ],
)
def test_config_checks(kw, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kw)
