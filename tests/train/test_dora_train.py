"""``lorafuse train --use-dora``: PEFT's DoRA adapters trained on the fused DoRA op; the saved
adapter loads in stock PEFT with the trained model's outputs."""

from __future__ import annotations

import argparse

import pytest
import torch

from lorafuse.commands._args import add_dataclass_arguments
from lorafuse.testing import assert_close
from lorafuse.train.config import ConfigError, TrainConfig


def test_use_dora_flag_and_refusal():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, TrainConfig)
    assert TrainConfig.from_dict(vars(parser.parse_args(["--use-dora"]))).use_dora
    with pytest.raises(ConfigError, match="use_dora=True: stock PEFT's DoRA forward cannot read"):
        TrainConfig(use_dora=True, load_in_4bit=True, fused=False)


def _train(cfg):
    from lorafuse.train import distributed as dist
    from lorafuse.train.engine import Trainer

    ctx = dist.setup(cfg.strategy, device=cfg.device)
    try:
        trainer = Trainer(cfg, ctx)
        trainer.setup()
        return trainer, trainer.run()
    finally:
        dist.cleanup(ctx)


@pytest.mark.slow  # end to end: lorafuse train, save, stock reload
@pytest.mark.parametrize("quant", [False, True], ids=["dora", "qdora"])
def test_dora_trains_fused_and_loads_in_stock_peft(make_config, quant):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorafuse.models.nf4 import Linear4bit
    from lorafuse.patching.peft_lora import is_fused_lora, runs_dora

    cfg = make_config(use_dora=True, max_steps=2, lr=1e-2, load_in_4bit=quant)
    trainer, summary = _train(cfg)
    fused = [m for m in trainer.model.modules() if is_fused_lora(m)]
    assert fused and all(runs_dora(m) for m in fused)
    assert all(isinstance(m.get_base_layer(), Linear4bit) == quant for m in fused)
    mags = [p for n, p in trainer.model.named_parameters() if "lora_magnitude_vector" in n]
    assert mags and all(p.requires_grad for p in mags)
    x = torch.randint(0, 128, (1, 10))
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=x).logits
        base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
        if quant:  # QDoRA: stock PEFT's DoRA on a dense base holding the dequantized NF4 values
            dense = dict(base.named_modules())
            for name, m in trainer.model.base_model.model.named_modules():
                if isinstance(m, Linear4bit):
                    target = dense[name.removesuffix(".base_layer")]
                    target.weight.data.copy_(m.weight.dequantize(torch.float32))
        loaded = PeftModel.from_pretrained(base, summary["adapter"]).eval()
        assert loaded.peft_config["default"].use_dora
        got = loaded(input_ids=x).logits  # stock PEFT's own DoRA forward
    # fp32, the fused DoRA op vs PEFT's DoRA on the same trained adapter: 1e-5 of the logits'
    # scale (measured: both ~1.5e-5 from fp64 at max |logit| 13; tests/ops/test_dora.py)
    assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5, name="logits")
