"""A vision-language adapter (language + vision LoRA, projector in full) merged into a stock HF
dir that transformers reloads with the adapter's outputs; the saved adapter reloads in stock
PEFT with identical outputs; GGUF export of a VLM is refused with a clear message."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForImageTextToText

from lorafuse.errors import LorafuseError
from lorafuse.export.merge import merge_adapter
from lorafuse.models.vision import FastVisionModel
from lorafuse.models.vision_processor import load_processor
from lorafuse.testing import assert_close
from lorafuse.testing.vlm import save_tiny_vlm, vlm_batch


def _load(path):
    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl"])
def test_merge_and_peft_reload_match(tmp_path, family):
    base_dir, adapter, out = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    _, processor = save_tiny_vlm(base_dir, family)
    model = FastVisionModel.get_peft_model(
        _load(base_dir), r=4, finetune_vision=True, train_projector=True,
        use_gradient_checkpointing=False, init_lora_weights=False, cpu_heap_policy=False,
    )  # fmt: skip
    with torch.no_grad():  # a trained projector differs from the base's
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(adapter)
    processor.save_pretrained(adapter)
    batch = {k: v for k, v in vlm_batch(processor).items() if k != "labels"}
    with torch.no_grad():
        want = model.eval()(**batch).logits
        reloaded = PeftModel.from_pretrained(_load(base_dir), adapter).eval()(**batch).logits
        assert_close(reloaded, want, atol=1e-5, rtol=1e-5, name="PEFT reload")
        merge_adapter(base_dir, adapter, out)
        merged = _load(out)(**batch).logits
        assert_close(merged, want, atol=1e-5, rtol=1e-5, name="merged")
        assert not torch.allclose(_load(base_dir)(**batch).logits, want, atol=1e-3)
    assert load_processor(out).image_processor is not None


def test_gguf_export_of_a_vlm_is_refused(tmp_path):
    import json

    from lorafuse.export.gguf_export import check_exportable

    save_tiny_vlm(tmp_path, "qwen2_vl")
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(LorafuseError, match="vision-language model: its GGUF export .* mmproj"):
        check_exportable(config, "f16")
