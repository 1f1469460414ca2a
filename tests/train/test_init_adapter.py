"""--init-adapter: a new run starts from saved LoRA weights (weights only, fresh optimizer)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from lorafuse.train import distributed as dist
from lorafuse.train.engine import Trainer, TrainingError, train


def test_init_adapter_loads_weights(make_config, tmp_path):
    first = train(make_config(output_dir=str(tmp_path / "a"), batch_size=2, max_steps=2))
    saved = load_file(os.path.join(first["adapter"], "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k)  # it trained
    trainer = Trainer(
        make_config(output_dir=str(tmp_path / "b"), init_adapter=first["adapter"]),
        dist.setup("none"),
    )
    trainer.setup()
    live = {
        n.replace(".default", ""): p for n, p in trainer.model.named_parameters() if p.requires_grad
    }
    assert live.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(live[k].detach(), v), k
    assert trainer.step == 0 and not trainer.optimizer.state  # weights only


def test_init_adapter_missing(make_config, tmp_path):
    trainer = Trainer(make_config(init_adapter=str(tmp_path)), dist.setup("none"))
    with pytest.raises(TrainingError, match="no adapter_model.safetensors"):
        trainer.setup()
