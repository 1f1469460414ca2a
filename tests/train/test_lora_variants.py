"""PEFT's LoRA options in ``train``: rsLoRA, rank/alpha patterns, init choices, lora_bias, LoRA+.

Each option reaches ``peft.LoraConfig`` with PEFT's meaning; the fused path covers what the math
allows (rsLoRA and per-module ranks) and reports what stays stock (lora_bias); LoRA+ groups match
PEFT's ``create_loraplus_optimizer``; PiSSA / OLoRA adapters are saved converted, so stock PEFT
loads them on the original base with the trained model's outputs.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from lorafuse.commands._args import add_dataclass_arguments
from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.optim import build_optimizer, loraplus_groups


def test_config_fields_and_errors():
    cfg = TrainConfig(rank_pattern={"q_proj": 4}, alpha_pattern=["v_proj=32"])
    assert cfg.rank_pattern == ["q_proj=4"] and cfg.alpha_pattern == ["v_proj=32"]
    for bad, match in [
        (dict(rank_pattern=["q_proj"]), "rank_pattern: 'q_proj' is not module=N"),
        (dict(alpha_pattern={"q_proj": 0}), "alpha_pattern: 'q_proj=0'"),
        (dict(init_lora_weights="svd"), "init_lora_weights='svd'"),
        (dict(init_lora_weights="eva", method="dpo"), "eva initialises from the SFT training rows"),
        (dict(init_lora_weights="pissa_niter_4", load_in_4bit=True), "not with load_in_4bit"),
        (dict(init_lora_weights="olora", init_adapter="x"), "not together with init_adapter"),
        (dict(lora_bias=True, init_lora_weights="gaussian"), "lora_bias=True: PEFT allows it only"),
        (dict(loraplus_lr_ratio=0.0), "loraplus_lr_ratio=0.0: must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            TrainConfig(**bad)
    TrainConfig(init_lora_weights="pissa_niter_4")


def test_flags():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, TrainConfig)
    args = parser.parse_args(
        ["--rank-pattern", "q_proj=4", "o_proj=2",
         "--loraplus-lr-ratio", "16", "--lora-bias", "--use-rslora"]
    )  # fmt: skip
    cfg = TrainConfig.from_dict(vars(args))
    assert cfg.rank_pattern == ["q_proj=4", "o_proj=2"] and cfg.loraplus_lr_ratio == 16.0
    assert cfg.lora_bias and cfg.use_rslora


def _peft_model(seed=0, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lorafuse.testing import tiny_llama_config

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, **lora))


def test_loraplus_groups_match_peft():
    from peft.optimizers import create_loraplus_optimizer

    model = _peft_model(lora_bias=True)  # 1-D params: the B biases (no decay)
    cfg = TrainConfig(lr=1e-3, loraplus_lr_ratio=8.0, weight_decay=0.01)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ours = build_optimizer(cfg, [p for _, p in named], [n for n, _ in named])[0]
    peft = create_loraplus_optimizer(
        model, torch.optim.AdamW, lr=1e-3, loraplus_lr_ratio=8.0, loraplus_weight_decay=0.01
    )

    def by_param(opt):
        return {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}

    assert by_param(ours) == by_param(peft)
    lrs = {lr for lr, _ in by_param(ours).values()}
    assert lrs == {1e-3, 8e-3}  # both groups really present
    assert len(loraplus_groups(cfg, named)) == 3  # A, B, B no-decay (no embedding LoRA here)


def test_rslora_and_rank_pattern_stay_fused():
    from lorafuse.patching import patch_peft_model

    x = torch.randint(0, 128, (2, 12))
    stock = _peft_model(use_rslora=True, rank_pattern={"q_proj": 4}, alpha_pattern={"o_proj": 3})
    for n, p in stock.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)  # B = 0 would hide the scale
    fused = _peft_model(use_rslora=True, rank_pattern={"q_proj": 4}, alpha_pattern={"o_proj": 3})
    fused.load_state_dict(stock.state_dict())
    q = fused.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.shape[0] == 4 and q.scaling["default"] == 16 / 2
    report = patch_peft_model(fused).lorafuse_report
    assert not report.skipped, report.skipped
    with torch.no_grad():
        torch.testing.assert_close(fused(x).logits, stock(x).logits, atol=1e-5, rtol=1e-5)


def test_lora_bias_is_reported_stock():
    from lorafuse.patching import patch_peft_model

    report = patch_peft_model(_peft_model(lora_bias=True)).lorafuse_report
    assert report.skipped and all("lora_bias=True" in why for why in report.skipped.values())


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_mutating_init_saves_a_plain_lora(make_config, tiny_model_dir, init):
    """Trained PiSSA / OLoRA: the saved adapter on the untouched base gives the trained outputs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorafuse.train import distributed as dist
    from lorafuse.train.engine import Trainer

    cfg = make_config(init_lora_weights=init, max_steps=2, lr=1e-2)
    ctx = dist.setup(cfg.strategy, device=cfg.device)
    try:
        trainer = Trainer(cfg, ctx)
        trainer.setup()
        summary = trainer.run()
    finally:
        dist.cleanup(ctx)
    assert os.path.isdir(os.path.join(cfg.output_dir, "initial_adapter"))
    x = torch.randint(0, 128, (1, 10))
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=x).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, summary["adapter"]).eval()
        assert loaded.peft_config["default"].r == 2 * cfg.lora_r  # converted: plain LoRA, rank 2r
        torch.testing.assert_close(loaded(input_ids=x).logits, want, atol=1e-4, rtol=1e-4)


def test_loraplus_resume_is_exact(make_config, tmp_path):
    from safetensors.torch import load_file

    from lorafuse.train.engine import train

    kw = dict(loraplus_lr_ratio=4.0, max_steps=4, save_steps=2, lr_scheduler="constant")
    ref = train(make_config(output_dir=str(tmp_path / "ref"), **kw))
    run = make_config(output_dir=str(tmp_path / "run"), **kw)
    train(make_config(output_dir=run.output_dir, **{**kw, "max_steps": 2}))
    res = train(make_config(output_dir=run.output_dir, resume=run.output_dir, **kw))
    a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
    b = load_file(os.path.join(res["adapter"], "adapter_model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
