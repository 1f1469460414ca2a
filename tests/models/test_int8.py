"""``load_in_int8``: int8 base weights (Linear8bit) loaded, patched and trained; refused where the
int8 kernel cannot run, and with the options it does not combine with."""

from __future__ import annotations

import pytest
import torch

from lorafuse import FastLanguageModel
from lorafuse.models import int8
from lorafuse.ops import int8_linear
from lorafuse.testing import PLAIN, save_tiny_model

needs_int8 = pytest.mark.skipif(not int8_linear.available(), reason="no int8 kernel here")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(path, **PLAIN)
    return path


@needs_int8
def test_load_in_int8_trains_and_dequantizes_to_the_weights(tiny_model_dir):
    dense, _ = FastLanguageModel.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model, _ = FastLanguageModel.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32, load_in_int8=True
    )
    layers = [m for m in model.modules() if isinstance(m, int8.Linear8bit)]
    assert len(layers) == 7 * model.config.num_hidden_layers  # every projection, not the head
    w = dense.model.layers[0].mlp.down_proj.weight
    q = model.model.layers[0].mlp.down_proj.weight
    assert isinstance(q, int8.Int8Weight) and q.shape == w.shape
    err = (q.dequantize(torch.float32) - w).abs()
    assert bool((err <= q.ops["sw"][:, None] / 2 * (1 + 1e-6)).all())  # round to nearest
    peft_model = FastLanguageModel.get_peft_model(
        model, r=4, use_gradient_checkpointing=False, cpu_heap_policy=False
    )
    report = peft_model.lorafuse_report
    assert len(report.patched) == len(layers) and not report.skipped
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    losses = []
    for _ in range(3):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]  # it learns


def test_int8_options_that_do_not_combine(tiny_model_dir):
    from lorafuse.train.config import ConfigError, TrainConfig

    with pytest.raises(ValueError, match="exclude each other"):
        FastLanguageModel.from_pretrained(str(tiny_model_dir), load_in_4bit=True, load_in_int8=True)
    for bad in ({"load_in_4bit": True}, {"use_dora": True}, {"fused": False}):
        with pytest.raises(ConfigError, match="load_in_int8"):
            TrainConfig(model="m", data=["d.jsonl"], load_in_int8=True, **bad)


def test_refused_where_the_kernel_cannot_run(monkeypatch):
    from lorafuse.errors import LorafuseError

    monkeypatch.setattr(int8_linear, "available", lambda: False)
    with pytest.raises(LorafuseError, match="AMX-INT8 or AVX-512-VNNI"):
        int8.quantize_model_(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.float32)
