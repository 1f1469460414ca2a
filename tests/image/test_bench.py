"""`lorafuse bench --task sd15`: the real code path (fresh subprocess per configuration) on a tiny
UNet config, one step each; no timing assertions."""

from __future__ import annotations

import json

from lorafuse.commands import main
from lorafuse.testing import save_tiny_sd


def test_sd15_bench_runs_every_configuration(tmp_path, capsys):
    model = save_tiny_sd(tmp_path / "tiny", "sd15")
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--task", "sd15", "--unet-config", model, "--resolution", "64",
            "--ranks", "4", "--steps", "1", "--warmup", "0", "--repeats", "1", "--threads", "1",
            "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "lorafuse bench --task sd15" in out and "batch 1 x 64 px (8x8 latents)" in out
    assert "LoRA network: 48 modules, 48 fused" in out  # the tiny UNet's kohya targets
    data = json.loads(out_json.read_text())
    results = data["results"]
    assert set(results) == {"none", "kohya@r4", "peft@r4", "lorafuse@r4"}
    # Same seed, same inputs, zero-initialised up weights: every configuration's first loss is the
    # frozen UNet's, so the four runs trained the same model on the same batch.
    first = [r["first_loss"] for r in results.values()]
    assert max(first) - min(first) <= 1e-5 * abs(first[0]), first
    lora = {k: r["lora_params"] for k, r in results.items()}
    assert lora["none"] == 0 and lora["kohya@r4"] == lora["peft@r4"] == lora["lorafuse@r4"] > 0
    assert results["lorafuse@r4"]["overhead_s"] == (
        results["lorafuse@r4"]["step_time_s"] - results["none"]["step_time_s"]
    )


def test_bad_image_arguments_are_user_errors(capsys):
    assert main(["bench", "--task", "sd15", "--ranks", "8,x"]) == 2
    assert "--ranks must be comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "--task", "sd15", "--resolution", "100"]) == 2
    assert "--resolution must be a multiple of 64" in capsys.readouterr().err
    assert main(["bench", "--task", "sdxl", "--unet-config", "/nonexistent"]) == 2
    assert "no config.json there" in capsys.readouterr().err
