"""``lorafuse train --init-lora-weights eva``: PEFT's EVA init fed with the training rows
(lorafuse.train.eva), then trained on the fused path; the adapter loads in stock PEFT."""

from __future__ import annotations

import pytest
import torch

from lorafuse.testing import assert_close
from lorafuse.train.config import ConfigError, TrainConfig


def test_eva_refusals():
    with pytest.raises(ConfigError, match="eva initialises from the SFT training rows"):
        TrainConfig(init_lora_weights="eva", method="dpo")
    with pytest.raises(ConfigError, match="eva initialises from the SFT training rows"):
        TrainConfig(init_lora_weights="eva", init_adapter="x")


@pytest.mark.slow  # end to end: lorafuse train, save, stock reload
def test_eva_init_from_training_rows_trains_and_loads_in_stock_peft(make_config):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorafuse.train import distributed as dist
    from lorafuse.train.engine import Trainer

    cfg = make_config(init_lora_weights="eva", lora_r=4, max_steps=1, lr=1e-3, batch_size=4)
    ctx = dist.setup(cfg.strategy, device=cfg.device)
    try:
        trainer = Trainer(cfg, ctx)
        trainer.setup()
        # EVA's A rows are principal directions of the layer inputs: orthonormal, which the
        # default (Kaiming-uniform) init is not
        A = trainer.model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
        gram = A.weight @ A.weight.t()
        assert_close(gram, torch.eye(gram.shape[0]), atol=1e-4, rtol=0, name="A·Aᵀ")
        assert trainer.model.lorafuse_report.n_patched == trainer.model.lorafuse_report.n_lora
        summary = trainer.run()
    finally:
        dist.cleanup(ctx)
    x = torch.randint(0, 128, (1, 10))
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=x).logits
        base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, summary["adapter"]).eval()
        got = loaded(input_ids=x).logits
    assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5, name="logits")


@pytest.mark.slow  # three short training runs
def test_eva_resume_is_exact(make_config, tmp_path):
    """Resuming re-runs the init on the same rows (same ranks, deterministic), then loads the
    checkpoint: the resumed run ends on the uninterrupted run's adapter bit for bit."""
    import os

    from safetensors.torch import load_file

    from lorafuse.train.engine import train

    kw = dict(init_lora_weights="eva", lora_r=4, batch_size=4, max_steps=4, save_steps=2,
              lr_scheduler="constant")  # fmt: skip
    ref = train(make_config(output_dir=str(tmp_path / "ref"), **kw))
    run = str(tmp_path / "run")
    train(make_config(output_dir=run, **{**kw, "max_steps": 2}))
    res = train(make_config(output_dir=run, resume=run, **kw))
    a = load_file(os.path.join(ref["adapter"], "adapter_model.safetensors"))
    b = load_file(os.path.join(res["adapter"], "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
