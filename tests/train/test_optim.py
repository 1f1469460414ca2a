"""Optimizer choice, lr schedules, optional extras that must fail clearly."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from lorafuse.train.config import ConfigError, TrainConfig
from lorafuse.train.optim import build_optimizer, build_scheduler, lr_factor


def test_schedules():
    # warmup 2 of 10 steps: 1/2, 1, then cosine / linear from the peak to 0
    assert [lr_factor(s, 10, 2, "cosine") for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, 10, 2, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(6, 10, 2, "linear") == pytest.approx(0.5)
    assert lr_factor(9, 10, 0, "constant") == 1.0
    p = torch.nn.Parameter(torch.zeros(3))
    opt, desc = build_optimizer(TrainConfig(lr=1.0, warmup_steps=2), [p])
    assert desc.startswith("AdamW")
    sched = build_scheduler(TrainConfig(lr=1.0, warmup_steps=2), opt, 10)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] < 0.05


def test_no_trainable_params():
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer(TrainConfig(), [])


@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes installed"
)
def test_adamw_8bit_without_bitsandbytes_says_so():
    with pytest.raises(ConfigError, match="optimizer=adamw_8bit needs bitsandbytes"):
        build_optimizer(TrainConfig(optimizer="adamw_8bit"), [torch.nn.Parameter(torch.zeros(2))])


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow", "trackio"])
def test_missing_tracker_library_names_the_extra(tmp_path, monkeypatch, tracker):
    from lorafuse.errors import LorafuseError
    from lorafuse.train.monitor import Monitor

    monkeypatch.setitem(sys.modules, tracker, None)  # import raises ImportError
    with pytest.raises(LorafuseError, match=rf"pip install 'lorafuse\[{tracker}\]'") as err:
        Monitor(str(tmp_path), 10, 0, enabled=True, progress=False, report_to=(tracker,))
    assert "\n" not in str(err.value)
