"""FastVisionModel on tiny Idefics3 / Qwen2-VL / Qwen2.5-VL models: loss and every LoRA gradient
equal stock transformers + PEFT on the same image+text batch (fp32), the towers LoRA reaches, the
projector on request, loading from a stock HF dir (4-bit too) and the processor without
torchvision."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lorafuse.models.vision import FastVisionModel, target_pattern
from lorafuse.models.vision_processor import VisionModelError
from lorafuse.testing import assert_close
from lorafuse.testing.llm import save_tiny_model
from lorafuse.testing.vlm import save_tiny_vlm, shape_image, tiny_vlm, vlm_batch

FAST = {"idefics3": "llama", "qwen2_vl": "qwen2vl", "qwen2_5_vl": "qwen2_5_vl"}  # report prefixes


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _lora(base, pattern):
    torch.manual_seed(3407)  # the same adapter init as FastVisionModel.get_peft_model's
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules=pattern, init_lora_weights=False,
                     task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(base, cfg).train()


def _run(model, batch):
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), _grads(model)


SLOW = pytest.mark.slow  # the same check on more cases: CI runs them, a quick run skips them
CASES = [
    ("idefics3", False), ("idefics3", True), ("qwen2_vl", True), ("qwen2_5_vl", False),
    pytest.param("qwen2_vl", False, marks=SLOW), pytest.param("qwen2_5_vl", True, marks=SLOW),
]  # fmt: skip


@pytest.mark.parametrize("family, vision", CASES)
def test_matches_stock_peft(family, vision):
    """fp32 1e-5 against stock (rtol 1e-4 on gradients, as tests/patching/test_families.py).
    Where stock fp32 is itself further than that from the fp64 result (ill-conditioned entries:
    Qwen2.5-VL's first ViT block's qkv, ~1.8e-4 off), ours must be as close to fp64 as stock."""
    base, processor = tiny_vlm(family)
    batch = vlm_batch(processor)  # two rows of different lengths: padded, masks matter
    stock_base, oracle_base = copy.deepcopy(base), copy.deepcopy(base).double()
    ours = FastVisionModel.get_peft_model(
        base, r=4, finetune_vision=vision, use_gradient_checkpointing=False,
        init_lora_weights=False, cpu_heap_policy=False,
    ).train()  # fmt: skip
    pattern = target_pattern(stock_base, None, vision)
    stock, oracle = _lora(stock_base, pattern), _lora(oracle_base, pattern)
    report = ours.lorafuse_report
    fast = {name.split("[")[0] for name in report.fast_paths}
    p = FAST[family]
    assert {f"{p}.attention", f"{p}.mlp", f"{p}.rms_norm", f"{p}.causal_lm_loss"} <= fast
    assert not report.skipped, report.skipped  # every LoRA Linear fused
    loss, got = _run(ours, batch)
    ref, want = _run(stock, batch)
    batch64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    _, truth = _run(oracle, batch64)
    assert_close(loss, ref, atol=1e-5, rtol=1e-5, name="loss")
    assert got.keys() == want.keys() and len(got) > 0
    assert any(("visual" in n or "vision_model" in n) for n in got) == vision
    for n, g in want.items():
        stock_err = (g.double() - truth[n]).abs().max().item()
        if stock_err <= 1e-5:
            assert_close(got[n], g, atol=1e-5, rtol=1e-4, name=n)
        else:
            ours_err = (got[n].double() - truth[n]).abs().max().item()
            assert ours_err <= 1.5 * stock_err, (n, ours_err, stock_err)


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl"])
def test_projector_trains_on_request(family):
    base, _ = tiny_vlm(family)
    model = FastVisionModel.get_peft_model(
        base, r=4, train_projector=True, use_gradient_checkpointing=False, cpu_heap_policy=False
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    projector = "connector" if family == "idefics3" else "merger"
    assert any(projector in n and "lora" not in n for n in trainable)
    assert not any(projector in n and "lora" in n for n in trainable)  # in full, not LoRA
    vision = [n for n in trainable if ("visual" in n or "vision_model" in n)]
    assert all(projector in n for n in vision), vision  # the rest of the tower stays frozen


def test_bad_requests_are_clear():
    base, _ = tiny_vlm("qwen2_vl")
    with pytest.raises(ValueError, match="nothing to train"):
        FastVisionModel.get_peft_model(base, finetune_language=False)
    with pytest.raises(ValueError, match="none of \\['wq'\\]"):
        FastVisionModel.get_peft_model(base, target_modules=["wq"])


@pytest.mark.parametrize("family", [pytest.param("idefics3", marks=SLOW), "qwen2_5_vl"])
def test_loads_stock_dir_and_4bit(tmp_path, family):
    from transformers import AutoModelForImageTextToText

    save_tiny_vlm(tmp_path, family)
    model, processor = FastVisionModel.from_pretrained(str(tmp_path), dtype="float32")
    stock = AutoModelForImageTextToText.from_pretrained(str(tmp_path), dtype=torch.float32)
    batch = {k: v for k, v in vlm_batch(processor).items() if k != "labels"}
    with torch.no_grad():
        assert_close(model(**batch).logits, stock(**batch).logits, atol=1e-5, rtol=1e-5,
                     name="logits")  # fmt: skip
    q, _ = FastVisionModel.from_pretrained(str(tmp_path), dtype="float32", load_in_4bit=True)
    peft_model = FastVisionModel.get_peft_model(q, r=4, use_gradient_checkpointing=True,
                                                cpu_heap_policy=False)  # fmt: skip
    peft_model.train()
    loss = peft_model(**vlm_batch(processor)).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for n, p in peft_model.named_parameters() if p.requires_grad)


def test_text_only_dir_is_refused(tmp_path):
    save_tiny_model(tmp_path)
    with pytest.raises(VisionModelError, match="text-only model.*FastLanguageModel"):
        FastVisionModel.from_pretrained(str(tmp_path))


def test_qwen_processor_without_torchvision(tmp_path):
    """Saved files name the stock processor class; loading builds it from its parts here."""
    from lorafuse.models.vision_processor import load_processor

    save_tiny_vlm(tmp_path, "qwen2_vl")
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen2VLProcessor"
    processor = load_processor(tmp_path)
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>hi"],
                    images=[shape_image()], return_tensors="pt")  # fmt: skip
    n_tokens = int(out["image_grid_thw"].prod()) // 4  # 2x2 merge
    assert int((out["input_ids"] == processor.image_token_id).sum()) == n_tokens
    if hasattr(processor, "stock_class"):  # built from its parts (no working torchvision)
        with pytest.raises(VisionModelError, match="videos are not supported"):
            processor(text=["x"], videos=[[shape_image()]])
