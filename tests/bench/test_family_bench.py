"""`lorafuse bench`'s late-2026 shapes: the configs build the architecture they name (on the meta
device: no weights), with the published sizes, the layer pattern kept when trimmed, and the dense
Qwen3 comparison model as large as the Qwen3.5 one."""

from __future__ import annotations

import pytest
import torch

from lorafuse.bench.config import FAMILY_MODELS, model_config, targets
from lorafuse.commands import main


def _meta_model(name, layers=None):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(name, layers))


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_qwen35_and_dense_qwen3_have_the_same_size():
    qwen35, dense = _meta_model("qwen3.5-0.8b"), _meta_model("qwen3-0.8b-dense")
    assert (
        type(qwen35).__name__ == "Qwen3_5ForCausalLM" and type(dense).__name__ == "Qwen3ForCausalLM"
    )
    # Qwen3.5-0.8B's text model: 0.75 B (the published 0.8 B counts its vision tower too)
    assert 0.74e9 < _params(qwen35) < 0.76e9
    assert abs(_params(dense) / _params(qwen35) - 1) < 0.01
    assert (
        qwen35.config.layer_types
        == ["linear_attention"] * 3
        + ["full_attention"] * 1
        + (["linear_attention"] * 3 + ["full_attention"]) * 5
    )


def test_trimmed_models_keep_their_layer_pattern():
    cfg = model_config("qwen3.5-0.8b", layers=8)
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    gemma = model_config("gemma4-e2b", layers=10)
    assert gemma.layer_types == (["sliding_attention"] * 4 + ["full_attention"]) * 2
    assert gemma.num_kv_shared_layers == 5  # both layer types own their k/v before the sharing
    assert gemma.kv_sharing_modes[5:] == ["reuse"] * 5
    full = model_config("gemma4-e2b")
    assert (full.num_hidden_layers, full.num_kv_shared_layers, full.hidden_size) == (35, 20, 1536)


def test_gemma4_e2b_builds_as_the_text_model():
    model = _meta_model("gemma4-e2b", layers=5)
    assert type(model).__name__ == "Gemma4ForCausalLM"
    assert model.config.final_logit_softcapping == 30.0
    assert all(targets(m) == "all-linear" for m in FAMILY_MODELS)


@pytest.mark.parametrize("argv", [["--model", "tiny", "--layers", "2"],
                                  ["--model", "gemma4-e2b", "--layers", "0"]])  # fmt: skip
def test_layers_is_refused_where_it_does_not_apply(argv, capsys):
    assert main(["bench", *argv]) == 2
    assert "--layers takes N >= 1" in capsys.readouterr().err
