"""Reward models (rm): our Bradley-Terry loss, and the gradients of the LoRA weights and the score
head, equal TRL's ``RewardTrainer.compute_loss`` on a transformers sequence classifier with the
same weights (margin and center-rewards term included); ``lorafuse train --method rm`` trains, and
the saved adapter loads on ``AutoModelForSequenceClassification`` with the same scores; resume is
bit for bit; config checks."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lorafuse.testing import assert_close
from lorafuse.testing.preference import TARGETS, lora_grads, pair_models, trl_pair_batch
from lorafuse.train import distributed as dist
from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.engine import Trainer, train
from lorafuse.train.preference import collate_pairs
from lorafuse.train.reward import (
    RewardObjective,
    attach_score_head,
    last_token_index,
    score_head,
    sequence_rewards,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
HEAD = "base_model.model.score.modules_to_save.default.weight"


@pytest.fixture(scope="module")
def models(plain_model_dir, pair_file, tmp_path_factory):
    """(tokenizer, pairs, our patched model with a score head, TRL RewardTrainer on a stock
    sequence classifier with the same LoRA and head weights)."""
    from datasets import Dataset
    from peft import (
        LoraConfig,
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    tok, pairs, stock, ours = pair_models(plain_model_dir, pair_file, n_pairs=4)
    attach_score_head(ours)
    with torch.no_grad():  # rewards of order 1, so the loss is not flat
        torch.manual_seed(1)
        score_head(ours).modules_to_save.default.weight.normal_(std=0.3)
    seq = AutoModelForSequenceClassification.from_pretrained(
        plain_model_dir, num_labels=1, dtype=torch.float32
    )
    seq.config.pad_token_id = tok.pad_token_id
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, task_type="SEQ_CLS")
    seq = get_peft_model(seq, lora)
    state = get_peft_model_state_dict(stock)  # the LoRA weights, and our head as PEFT saves it
    state["base_model.model.score.weight"] = ours.get_parameter(HEAD).detach().clone()
    result = set_peft_model_state_dict(seq, state)
    assert not result.unexpected_keys
    assert torch.equal(seq.get_parameter(HEAD), ours.get_parameter(HEAD))
    args = RewardConfig(output_dir=str(tmp_path_factory.mktemp("trl_rm")), report_to=[],
                        use_cpu=True, bf16=False, gradient_checkpointing=False)  # fmt: skip
    ds = Dataset.from_list([{"chosen": "a b", "rejected": "a c"}])
    trainer = RewardTrainer(model=seq, args=args, train_dataset=ds, processing_class=tok)
    return tok, pairs, ours, trainer


def _trl_inputs(pairs, pad_id, margin):
    batch = trl_pair_batch(pairs, pad_id)  # right-padded [chosen..., rejected...], as TRL's
    del batch["completion_mask"]
    if margin:
        batch["margin"] = torch.tensor([0.5, -0.25, 1.0, 0.0][: len(pairs)])
    return batch


@pytest.mark.parametrize("margin, center", [(False, None), (True, None), (True, 0.05)])
def test_loss_and_grads_equal_trl(models, margin, center):
    tok, pairs, ours, trl = models
    trl.args.center_rewards_coefficient = center
    inputs = _trl_inputs(pairs, tok.pad_token_id, margin)
    ref_loss = trl.compute_loss(trl.model, dict(inputs))
    ref_loss.backward()
    ref_grads = lora_grads(trl.model)
    if margin:
        pairs = [
            type(p)(p.chosen, p.rejected, p.n_examples, float(m))
            for p, m in zip(pairs, inputs["margin"])
        ]
    obj = RewardObjective(center, tok.pad_token_id, "cpu")
    counts = obj.counts(pairs)
    loss, sums = obj.loss(ours, pairs, counts)
    loss.backward()
    grads = lora_grads(ours)
    assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5, name="loss")
    assert grads.keys() == ref_grads.keys() and HEAD in grads and len(grads) > 1
    for k in grads:
        scale = ref_grads[k].abs().max().item()
        assert scale > 0, k
        assert_close(grads[k], ref_grads[k], atol=1e-5 * scale, rtol=1e-5, name=k)
    m = obj.metrics(sums, counts)
    trl_metrics = trl._metrics["train"]
    assert m["accuracy"] == pytest.approx(trl_metrics["accuracy"][-1], abs=1e-6)
    assert m["margin"] == pytest.approx(trl_metrics["margin"][-1], rel=1e-5, abs=1e-6)
    assert m["mean_reward"] == pytest.approx(trl_metrics["mean_reward"][-1], rel=1e-5, abs=1e-6)


def test_last_token_is_transformers_rule():
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 0, 7, 8, 9], [0, 0, 0, 0, 0]])
    assert last_token_index(ids, 0).tolist() == [2, 4, 0]


# ---- the engine ------------------------------------------------------------------------------
def _log(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def test_training_learns_the_preference(pref_config):
    cfg = pref_config(method="rm", beta=None, batch_size=4, max_steps=8, lr=3e-3)
    train(cfg)
    log = _log(cfg.output_dir)
    assert {"loss", "accuracy", "margin", "mean_reward"} <= log[0].keys()
    assert log[-1]["margin"] > log[0]["margin"] + 0.1, [r["margin"] for r in log]
    assert log[-1]["loss"] < log[0]["loss"]


def test_saved_adapter_loads_as_a_sequence_classifier(pref_config, tiny_model_dir, pair_file,
                                                      tmp_path, capsys):  # fmt: skip
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    cfg = pref_config(method="rm", beta=None, batch_size=4, max_steps=2, lr=3e-3)
    trainer = Trainer(cfg, dist.setup("none"))
    trainer.setup()
    for _ in range(2):
        trainer.train_step()
    path = trainer.save("final", False)
    pad = trainer.tokenizer.pad_token_id
    batch = collate_pairs(trainer.data.train[:4], pad, "cpu")
    trainer.model.eval()
    with torch.no_grad():
        ours = sequence_rewards(trainer.model, batch, pad)
    saved = json.load(open(os.path.join(path, "adapter_config.json")))
    assert saved["task_type"] == "SEQ_CLS" and "score" in saved["modules_to_save"]
    seq = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir, num_labels=1, dtype=torch.float32, pad_token_id=pad
    )
    seq = PeftModel.from_pretrained(seq, path).eval()
    with torch.no_grad():
        theirs = seq(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert ours.abs().max() > 1e-3  # a trained head, not zeros
    assert_close(ours, theirs.squeeze(-1), atol=1e-5, rtol=1e-5, name="scores")
    # `lorafuse eval --pairs`: pairwise accuracy of the same adapter, scored the same way
    from lorafuse.commands import main

    out = tmp_path / "eval.json"
    rc = main(["eval", "--checkpoint", path, "--pairs", pair_file, "--dtype", "fp32",
               "--max-seq-length", "64", "--json", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    assert "pairwise accuracy (n=24)" in capsys.readouterr().out
    col = json.loads(out.read_text())["columns"]
    (res,) = col.values()
    with torch.no_grad():
        rows = trainer.data.train + trainer.data.eval  # the same 24 pairs
        r = sequence_rewards(trainer.model, collate_pairs(rows, pad, "cpu"), pad)
    want = (r[: len(rows)] > r[len(rows) :]).float().mean().item()
    assert res["pairs"]["n"] == 24 and res["pairs"]["accuracy"] == pytest.approx(want)


def test_resume_is_bit_for_bit(pref_config, tmp_path):
    args = dict(method="rm", beta=None, batch_size=2, grad_accum=2, max_steps=4, save_steps=2)
    ref = train(pref_config(output_dir=str(tmp_path / "ref"), **args))
    resumed = train(pref_config(output_dir=str(tmp_path / "res"),
                                resume=str(tmp_path / "ref" / "checkpoint-2"), **args))  # fmt: skip
    assert resumed["steps"] == ref["steps"] == 4
    assert resumed["train_loss"] == ref["train_loss"]  # bit-exact, not approximately
    from safetensors.torch import load_file

    a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
    b = load_file(os.path.join(resumed["adapter"], "adapter_model.safetensors"))
    assert any("score" in k for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"method": "rm", "beta": 0.1}, "beta"),
        ({"method": "rm", "loss_type": "sigmoid"}, "loss_type"),
        ({"method": "rm", "center_rewards_coefficient": -1.0}, "center_rewards_coefficient"),
        ({"method": "dpo", "center_rewards_coefficient": 0.01}, "center_rewards_coefficient"),
    ],
)
def test_config_checks(kw, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kw)
