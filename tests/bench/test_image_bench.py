"""`lorafuse bench --task sd15`: the real code path (fresh subprocess per configuration) on a tiny
UNet config, one step each; no timing assertions."""

from __future__ import annotations

import json
import os

import pytest

from lorafuse.bench import image as bench
from lorafuse.commands import main
from lorafuse.testing import save_tiny_sd, single_thread


@pytest.fixture(autouse=True)
def _one_thread():
    yield from single_thread()  # the in-process tiny steps: threads only add barrier stalls


@pytest.fixture(scope="module")
def tiny_sd15(tmp_path_factory):
    return save_tiny_sd(tmp_path_factory.mktemp("tiny") / "sd15", "sd15")


def test_sd15_bench_cli_end_to_end(tiny_sd15, tmp_path, capsys):
    # Two configurations only: each fresh worker pays diffusers' ~10 s import (peft, transformers);
    # the other two are built and stepped in-process below.
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--task", "sd15", "--unet-config", tiny_sd15, "--resolution", "64",
            "--ranks", "4", "--configs", "none,lorafuse", "--steps", "1", "--warmup", "0",
            "--repeats", "1", "--threads", "1", "--json", str(out_json)]  # fmt: skip
    env_before = {k: os.environ.get(k) for k in bench.STEADY_MALLOC}
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "lorafuse bench --task sd15" in out and "batch 1 x 64 px (8x8 latents)" in out
    assert "LoRA network: 48 modules, 48 fused" in out  # the tiny UNet's kohya targets
    data = json.loads(out_json.read_text())
    results = data["results"]
    assert set(results) == {"none", "lorafuse@r4"}
    for run in data["runs"]["none"] + data["runs"]["lorafuse@r4"]:
        # every worker ran under the same steady malloc settings, and counted its page faults
        assert run["malloc_env"] == bench.STEADY_MALLOC
        assert len(run["minflt"]) == len(run["times"]) == 1
    assert {k: os.environ.get(k) for k in bench.STEADY_MALLOC} == env_before  # put back
    ours = results["lorafuse@r4"]
    assert ours["overhead_s"] == ours["step_time_s"] - results["none"]["step_time_s"]
    assert ours["lora_params"] > 0 == results["none"]["lora_params"]


def test_every_configuration_steps_the_same_model(tiny_sd15):
    # Same seed, same inputs, zero-initialised up weights: every configuration's first loss is the
    # frozen UNet's, so the four train the same model on the same batch.
    spec = {"task": "sd15", "unet_config": bench.unet_config("sd15", tiny_sd15),
            "resolution": 64, "batch": 1, "steps": 1, "warmup": 0, "dtype": "fp32",
            "device": "cpu", "threads": None, "backend": None, "rank": 4}  # fmt: skip
    outs = {c: bench.run_worker({**spec, "config": c}) for c in bench.CONFIGS}
    first = [o["losses"][0] for o in outs.values()]
    assert max(first) - min(first) <= 1e-5 * abs(first[0]), first
    lora = {c: o["lora_params"] for c, o in outs.items()}
    assert lora["none"] == 0 and lora["kohya"] == lora["peft"] == lora["lorafuse"] > 0
    assert outs["peft"]["report"] == "PEFT: 48 LoRA modules"
    assert outs["kohya"]["report"].startswith("LoRA network: 48 modules, 0 fused")


def test_bad_image_arguments_are_user_errors(capsys):
    assert main(["bench", "--task", "sd15", "--ranks", "8,x"]) == 2
    assert "--ranks must be comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "--task", "sd15", "--configs", "none,stock"]) == 2
    assert "--configs: unknown stock" in capsys.readouterr().err
    assert main(["bench", "--task", "sd15", "--resolution", "100"]) == 2
    assert "--resolution must be a multiple of 64" in capsys.readouterr().err
    assert main(["bench", "--task", "sdxl", "--unet-config", "/nonexistent"]) == 2
    assert "no config.json there" in capsys.readouterr().err
