"""SimPO and CPO: our loss and LoRA gradients equal TRL's ``CPOTrainer`` (``cpo_loss`` on its
``get_batch_logps``, plus ``cpo_alpha`` times its chosen NLL) on the same batch and weights;
``lorafuse train --method simpo|cpo`` raises the reward margin; accumulation gives the big
batch's gradient; config checks."""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lorafuse.testing import assert_close
from lorafuse.testing.preference import lora_grads, pair_models, trl_pair_batch
from lorafuse.train import distributed as dist
from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.cpo import CPOObjective
from lorafuse.train.engine import Trainer, train

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def models(plain_model_dir, pair_file):
    return pair_models(plain_model_dir, pair_file)


def _trl_loss(stock, pairs, pad_id, *, beta, loss_type, cpo_alpha, simpo_gamma, label_smoothing):
    """TRL's ``get_batch_loss_metrics`` loss from the stock model's full logits."""
    from trl.experimental.cpo import CPOTrainer

    batch = trl_pair_batch(pairs, pad_id)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logits = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    B = len(pairs)
    logps = CPOTrainer.get_batch_logps(
        logits, labels, average_log_prob=loss_type in ("ipo", "simpo")
    )
    fake = SimpleNamespace(beta=beta, alpha=0.0, loss_type=loss_type, simpo_gamma=simpo_gamma,
                           label_smoothing=label_smoothing,
                           accelerator=SimpleNamespace(device=torch.device("cpu")))  # fmt: skip
    losses, r_c, r_r = CPOTrainer.cpo_loss(fake, logps[:B], logps[B:])
    # TRL's concatenated_forward: nn.CrossEntropyLoss over the chosen rows, shifted
    nll = F.cross_entropy(logits[:B, :-1].flatten(0, 1), labels[:B, 1:].flatten())
    return losses.mean() + cpo_alpha * nll, r_c, r_r


CASES = [  # (loss_type, beta, cpo_alpha, label_smoothing)
    ("simpo", 2.0, 0.0, 0.0),  # SimPO
    ("simpo", 0.5, 1.0, 0.1),  # CPO-SimPO, smoothed
    ("sigmoid", 0.5, 1.0, 0.0),  # CPO
    ("hinge", 0.05, 1.0, 0.0),
    ("ipo", 0.5, 0.5, 0.0),
]


@pytest.mark.parametrize("loss_type, beta, cpo_alpha, label_smoothing", CASES)
def test_loss_and_grads_equal_trl(models, loss_type, beta, cpo_alpha, label_smoothing):
    tok, pairs, stock, ours = models
    kw = dict(beta=beta, loss_type=loss_type, cpo_alpha=cpo_alpha, simpo_gamma=0.7,
              label_smoothing=label_smoothing)  # fmt: skip
    ref_loss, ref_rc, ref_rr = _trl_loss(stock, pairs, tok.pad_token_id, **kw)
    ref_loss.backward()
    ref_grads = lora_grads(stock)
    truth_model = copy.deepcopy(stock).double()  # the oracle: stock's math in fp64
    _trl_loss(truth_model, pairs, tok.pad_token_id, **kw)[0].backward()
    truth = lora_grads(truth_model)
    obj = CPOObjective(beta, loss_type, cpo_alpha, 0.7, label_smoothing, tok.pad_token_id, "cpu")
    counts = obj.counts(pairs)
    loss, sums = obj.loss(ours, pairs, counts)
    loss.backward()
    grads = lora_grads(ours)
    assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5, name="loss")
    assert grads.keys() == ref_grads.keys() == truth.keys() and grads
    for k in grads:
        # As for DPO (tests/train/test_preference.py::_compare): a pair loss's gradient is the
        # difference of the chosen and rejected sequences' gradients, which share their prompt, so
        # fp32 rounding is amplified; ours and stock are each held to 5e-5 of the gradient's scale
        # from the fp64 truth (a wrong gradient is off by ~1e-1).
        t = truth[k]
        scale = t.abs().max().item()
        assert scale > 0, k
        for name, g in (("stock", ref_grads[k]), ("lorafuse", grads[k])):
            err = (g.double() - t).abs().max().item() / scale
            assert err < 5e-5, f"{k}: {name} is {err:.1e} of the gradient's scale from fp64"
    m = obj.metrics(sums, counts)
    assert m["rewards/chosen"] == pytest.approx(ref_rc.mean().item(), rel=1e-5, abs=1e-6)
    assert m["rewards/rejected"] == pytest.approx(ref_rr.mean().item(), rel=1e-5, abs=1e-6)


def test_padding_pairs_change_nothing(models):
    """Uneven distributed shards add zero-weight pairs: loss and gradients stay the same."""
    tok, pairs, _, ours = models
    obj = CPOObjective(0.5, "simpo", 1.0, 0.5, 0.0, tok.pad_token_id, "cpu")
    loss, _ = obj.loss(ours, pairs[:2], obj.counts(pairs[:2]))
    loss.backward()
    grads = lora_grads(ours)
    padded = pairs[:2] + [pairs[2].zeroed()]
    pad_loss, sums = obj.loss(ours, padded, obj.counts(padded))
    pad_loss.backward()
    assert bool(torch.isfinite(sums).all())
    assert_close(pad_loss.detach(), loss.detach(), atol=1e-6, rtol=1e-6, name="loss")
    for k, g in lora_grads(ours).items():
        assert_close(g, grads[k], atol=1e-6 * grads[k].abs().max().item(), rtol=1e-5, name=k)


# ---- the engine ------------------------------------------------------------------------------
def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


@pytest.mark.parametrize("method, beta", [("simpo", 2.0), ("cpo", 0.5)])
def test_training_lowers_the_loss(pref_config, method, beta):
    cfg = pref_config(method=method, beta=beta, batch_size=4, max_steps=6, lr=2e-3)
    train(cfg)
    log = _log(cfg.output_dir)
    keys = {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "logps/chosen"}  # fmt: skip
    assert keys <= log[0].keys()
    assert ("nll_loss" in log[0]) == (method == "cpo")
    assert log[-1]["loss"] < log[0]["loss"]
    if method == "cpo":  # summed log-probs: the pairs start far apart (margin ~20), NLL leads
        assert log[-1]["nll_loss"] < log[0]["nll_loss"] - 0.1, [r["nll_loss"] for r in log]
        return
    first, last = log[0]["rewards/margins"], log[-1]["rewards/margins"]
    assert last > first + 0.05, [r["rewards/margins"] for r in log]


def _first_step(cfg):
    trainer = Trainer(cfg, dist.setup("none"))
    trainer.setup()
    grads = {}
    trainer.optimizer.step = lambda: grads.update(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    )
    return trainer.train_step(), grads


def test_accumulation_gives_the_big_batch_gradient(pref_config):
    """CPO-SimPO (token-averaged pairs + a token-normalised NLL): 4 x 1 == 1 x 4."""
    kw = dict(method="simpo", cpo_alpha=1.0)
    big_fig, big = _first_step(pref_config(batch_size=4, grad_accum=1, **kw))
    acc_fig, acc = _first_step(pref_config(batch_size=1, grad_accum=4, **kw))
    assert abs(big_fig["loss"] - acc_fig["loss"]) <= 1e-5 * abs(big_fig["loss"])
    for k, v in big_fig["metrics"].items():
        assert acc_fig["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-5), k
    for name in big:  # fp32, reordered sums (as the SFT accumulation test)
        assert_close(acc[name], big[name], atol=1e-6, rtol=1e-4, name=name)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"method": "simpo", "loss_type": "sigmoid"}, "loss_type"),
        ({"method": "cpo", "loss_type": "simpo"}, "loss_type"),
        ({"method": "cpo", "cpo_alpha": -1.0}, "cpo_alpha"),
        ({"method": "dpo", "cpo_alpha": 1.0}, "cpo_alpha"),
        ({"method": "cpo", "loss_type": "hinge", "label_smoothing": 0.1}, "label_smoothing"),
    ],
)
def test_config_checks(kw, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kw)


def test_config_defaults():
    assert TrainConfig(method="cpo").cpo_alpha == 1.0
    simpo = TrainConfig(method="simpo")
    assert (simpo.cpo_alpha, simpo.loss_type, simpo.simpo_gamma) == (0.0, "simpo", 0.5)
