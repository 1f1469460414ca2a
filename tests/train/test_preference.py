"""DPO and ORPO: our losses and LoRA gradients equal TRL's on the same batch and weights; TRL's
own DPOTrainer runs on a patched model; training raises the reward margin; accumulation gives the
big batch's gradient; resume is bit for bit.

The equivalence tests use a tiny fp32 Llama whose weights are not scaled up (``scale=1``): its
logits are moderate, so the comparison measures the losses, not the rounding of huge logits.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

from lorafuse.testing import assert_close
from lorafuse.testing.preference import (
    TARGETS,
    lora_grads,
    pair_models,
    pair_records,
    trl_pair_batch,
)
from lorafuse.train import distributed as dist
from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.engine import Trainer, train
from lorafuse.train.preference import PreferenceObjective, dpo_loss

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden"),
]


@pytest.fixture(scope="module")
def models(plain_model_dir, pair_file):
    """(tokenizer, pairs, stock PEFT model with random non-zero LoRA, patched deep copy)."""
    return pair_models(plain_model_dir, pair_file)


_trl_batch, _lora_grads = trl_pair_batch, lora_grads


def _ours(model, pairs, pad_id, method, **kw):
    obj = PreferenceObjective(method, kw.pop("beta"), kw.pop("loss_type", "sigmoid"),
                              kw.pop("label_smoothing", 0.0), pad_id, torch.device("cpu"))  # fmt: skip
    loss, _ = obj.loss(model, pairs, obj.counts(pairs))
    loss.backward()
    return loss.detach(), _lora_grads(model)


def _compare(loss, grads, ref_loss, ref_grads, truth_grads=None):
    """Ours against stock (loss 1e-5); with ``truth_grads`` (stock in fp64), each gradient against
    that truth instead of against stock's fp32 gradient (see the bound below)."""
    assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5, name="loss")
    assert grads.keys() == ref_grads.keys() and grads
    for k in grads:
        if truth_grads is None:  # fp32: the fused kernels sum in another order than stock
            scale = ref_grads[k].abs().max().item()
            assert_close(grads[k], ref_grads[k], atol=1e-5 * scale, rtol=1e-5, name=k)
            continue
        # A DPO gradient is the difference of the chosen and the rejected sequences' gradients,
        # which share their prompt: stock rounds the shared rows alike in both and that rounding
        # cancels; kernels that block by row position (ours) round them differently, so fp32
        # noise is amplified. Measured against fp64 here: stock <= 0.6e-5 of the gradient's
        # scale, ours 0.8e-5 (AVX2 build) to 2.5e-5 (AVX-512 build), the two builds' kernels
        # each as accurate as the other against fp64. A wrong gradient is off by ~1e-1.
        truth = truth_grads[k].double()
        scale = truth.abs().max().item()
        for name, g in (("stock", ref_grads[k]), ("lorafuse", grads[k])):
            err = (g.double() - truth).abs().max().item() / scale
            assert err < 5e-5, f"{k}: {name} is {err:.1e} of the gradient's scale from fp64"


@pytest.fixture(scope="module")
def trl_dpo(models, plain_model_dir, tmp_path_factory):
    """A TRL DPOTrainer holding a fresh PEFT model with the same LoRA weights as ``models``."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    tok, _, stock, _ = models
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), beta=0.1, report_to=[],
                     use_cpu=True, bf16=False, gradient_checkpointing=False)  # fmt: skip
    ds = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    base = AutoModelForCausalLM.from_pretrained(plain_model_dir, dtype=torch.float32)
    # TRL builds the PEFT model itself (a fresh adapter: its reference is the adapter disabled)
    trainer = DPOTrainer(model=base, args=args, train_dataset=ds, processing_class=tok,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))  # fmt: skip
    result = set_peft_model_state_dict(trainer.model, get_peft_model_state_dict(stock))
    assert not result.unexpected_keys
    return trainer


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.5), ("ipo", 0.5), ("hinge", 0.05)])
def test_dpo_loss_and_grads_equal_trl(models, trl_dpo, loss_type, beta):
    tok, pairs, _, ours = models
    trl_dpo.beta, trl_dpo.loss_types, trl_dpo.loss_weights = beta, [loss_type], [1.0]
    batch = _trl_batch(pairs, tok.pad_token_id)
    ref_loss = trl_dpo._compute_loss(trl_dpo.model, batch, False)
    ref_loss.backward()
    ref_grads = {k.replace(".default", ""): v for k, v in _lora_grads(trl_dpo.model).items()}
    truth_model = copy.deepcopy(trl_dpo.model).double()  # the oracle: stock's math in fp64
    trl_dpo._compute_loss(truth_model, batch, False).backward()
    truth = {k.replace(".default", ""): v for k, v in _lora_grads(truth_model).items()}
    loss, grads = _ours(ours, pairs, tok.pad_token_id, "dpo", beta=beta, loss_type=loss_type)
    grads = {k.replace(".default", ""): v for k, v in grads.items()}
    assert loss.item() != pytest.approx(0.6931, abs=1e-3)  # policy != reference: a real test
    _compare(loss, grads, ref_loss.detach(), ref_grads, truth)


def test_dpo_label_smoothing_is_cdpo():
    """TRL 1.16's sigmoid loss has no label smoothing: check ours against the cDPO formula."""
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (torch.randn(5, generator=g) * 3 for _ in range(4))
    eps, beta = 0.2, 0.3
    losses, rew_c, rew_r = dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=eps)
    d = (c - rc) - (r - rr)
    expected = -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)
    assert_close(losses, expected, atol=1e-6, rtol=1e-6, name="cdpo")
    assert_close(rew_c - rew_r, beta * d, atol=1e-6, rtol=1e-6, name="margin")


def test_orpo_loss_and_grads_equal_trl(models):
    from types import SimpleNamespace

    from trl.experimental.orpo import ORPOTrainer

    tok, pairs, stock, ours = models
    beta = 0.25
    batch = _trl_batch(pairs, tok.pad_token_id)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logits = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    B = len(pairs)
    avg = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    fake = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=torch.device("cpu")))
    ratio_losses = ORPOTrainer.odds_ratio_loss(fake, avg[:B], avg[B:])[0]
    # NLL over the chosen response tokens (the ORPO paper's L_SFT; TRL's also counts the prompt)
    nll = F.cross_entropy(logits[:B, :-1].flatten(0, 1), labels[:B, 1:].flatten())
    ref_loss = nll - ratio_losses.mean()  # TRL's get_batch_loss_metrics
    ref_loss.backward()
    ref_grads = _lora_grads(stock)
    loss, grads = _ours(ours, pairs, tok.pad_token_id, "orpo", beta=beta)
    _compare(loss, grads, ref_loss.detach(), ref_grads)


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_padding_pairs_change_nothing(models, method):
    """Uneven distributed shards add zero-weight pairs: loss and gradients stay the same."""
    tok, pairs, _, ours = models
    loss, grads = _ours(ours, pairs[:2], tok.pad_token_id, method, beta=0.3)
    obj = PreferenceObjective(method, 0.3, "sigmoid", 0.0, tok.pad_token_id, torch.device("cpu"))
    padded = pairs[:2] + [pairs[2].zeroed()]
    pad_loss, sums = obj.loss(ours, padded, obj.counts(padded))
    pad_loss.backward()
    assert bool(torch.isfinite(sums).all())
    _compare(pad_loss.detach(), _lora_grads(ours), loss, grads)


def test_trl_dpo_trainer_runs_on_a_patched_model(models, plain_model_dir, tmp_path):
    """TRL's DPOTrainer, one step, on stock PEFT and on the same model patched: same loss."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from lorafuse import patch_peft_model

    tok = models[0]
    ds = Dataset.from_list(pair_records(4, seed=3))
    results = []
    for patched in (False, True):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(plain_model_dir, dtype=torch.float32)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
        model = get_peft_model(base, lora)
        if patched:
            patch_peft_model(model)
        args = DPOConfig(output_dir=str(tmp_path / str(patched)), max_steps=1, report_to=[],
                         per_device_train_batch_size=4, use_cpu=True, bf16=False, logging_steps=1,
                         gradient_checkpointing=False, save_strategy="no", seed=0)  # fmt: skip
        trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
        out = trainer.train()
        lora_b = [p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n]
        results.append((out.training_loss, lora_b))
    (stock_loss, stock_b), (our_loss, our_b) = results
    assert our_loss == pytest.approx(stock_loss, rel=1e-5, abs=1e-6)
    for a, b in zip(our_b, stock_b):
        assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-5, name="lora_B after a step")


# ---- the engine ------------------------------------------------------------------------------
def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_training_raises_the_reward_margin(pref_config, method):
    cfg = pref_config(method=method, batch_size=4, max_steps=6, lr=2e-3)
    train(cfg)
    log = _log(cfg.output_dir)
    keys = {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "tokens_per_s", "peak_mem_mb"}  # fmt: skip
    assert keys <= log[0].keys()
    first, last = log[0]["rewards/margins"], log[-1]["rewards/margins"]
    assert last > first + 0.1, [r["rewards/margins"] for r in log]
    assert log[-1]["loss"] < log[0]["loss"]


def _first_step(cfg):
    trainer = Trainer(cfg, dist.setup("none"))
    trainer.setup()
    grads = {}
    trainer.optimizer.step = lambda: grads.update(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    )
    return trainer.train_step(), grads


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_accumulation_gives_the_big_batch_gradient(pref_config, method):
    big_fig, big = _first_step(pref_config(method=method, batch_size=4, grad_accum=1))
    acc_fig, acc = _first_step(pref_config(method=method, batch_size=1, grad_accum=4))
    assert abs(big_fig["loss"] - acc_fig["loss"]) <= 1e-5 * abs(big_fig["loss"])
    assert big_fig["metrics"].keys() == acc_fig["metrics"].keys()
    for k, v in big_fig["metrics"].items():
        if k == "rewards/accuracies":  # step 1: policy == reference (B = 0), rewards are rounding
            continue
        assert acc_fig["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-5), k
    for name in big:
        # fp32, reordered sums: 1e-6 absolute + 1e-4 relative (as the SFT accumulation test)
        assert_close(acc[name], big[name], atol=1e-6, rtol=1e-4, name=name)


def test_resume_is_bit_for_bit(pref_config, tmp_path):
    args = dict(batch_size=2, grad_accum=2, max_steps=4, save_steps=2, lora_dropout=0.1)
    ref = train(pref_config(output_dir=str(tmp_path / "ref"), **args))
    resumed = train(pref_config(output_dir=str(tmp_path / "res"),
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
        ({"method": "nosuch"}, "method"),  # ppo is a method now: an unknown name
        ({"method": "dpo", "beta": 0.0}, "beta"),
        ({"method": "dpo", "loss_type": "robust"}, "loss_type"),
        ({"method": "dpo", "loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
        ({"method": "orpo", "train_on_inputs": True}, "train_on_inputs"),
    ],
)
def test_config_checks(kw, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kw)
