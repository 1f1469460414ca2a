"""Merging LoRA on expert tensors (PEFT ParamWrapper): the merged stock HF dir reloads in
transformers with the unmerged PEFT model's logits, whether the checkpoint stores experts one by
one (Qwen3-Next, Qwen3-MoE: transformers fuses them on load) or fused (gpt-oss, transposed;
Granite 4, renamed); routers' LoRA is folded too. Qwen3-Next's adapter from PEFT's own re-mapping
of gate_proj / up_proj / down_proj (``mlp.experts.base_layer.lora_A`` keys) merges."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from lorafuse.export.merge import merge_adapter
from lorafuse.models.fast_model import LLAMA_PROJECTIONS, lora_targets
from lorafuse.testing import chat_tokenizer
from lorafuse.testing.new_families import save_family_model


def _adapter(arch, root, targets=None):
    tok = chat_tokenizer()
    base = save_family_model(arch, root / "base", tok)
    if targets is None:  # lorafuse's default plan: experts, routers, shared experts
        targets, experts = lora_targets(base, None)
        params = experts.target_parameters
    else:
        params = None
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, target_parameters=params,
                        init_lora_weights=False)  # fmt: skip
    torch.manual_seed(0)
    get_peft_model(base, config).save_pretrained(root / "adapter")
    return tok


def _check_merge(root, tok, close):
    merge_adapter(root / "base", root / "adapter", root / "merged")
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, root / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    ids = torch.randint(3, len(tok), (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = peft_model(ids).logits
        with peft_model.disable_adapter():
            assert (ref - peft_model(ids).logits).abs().max() > 1e-2  # the adapter matters
        # fp32: x(W + sBA)ᵀ in both, the merged W rounded once from fp32 (summation order)
        close(merged(ids).logits, ref, atol=1e-4, rtol=1e-4, name="merged logits")


@pytest.mark.parametrize(
    "arch", ["Qwen3NextForCausalLM", "GptOssForCausalLM", "GraniteMoeHybridForCausalLM"]
)
def test_expert_lora_merges_to_the_peft_model_s_logits(arch, tmp_path, close):
    _check_merge(tmp_path, _adapter(arch, tmp_path), close)


def test_qwen3_next_adapter_from_peft_remapping_merges(tmp_path, close):
    """The adapter of the issue: target_modules gate/up/down_proj, which PEFT turns into the
    routed experts' nested ParamWrappers (keys mlp.experts.base_layer.lora_A ...)."""
    tok = _adapter("Qwen3NextForCausalLM", tmp_path, targets=LLAMA_PROJECTIONS)
    keys = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert b"mlp.experts.base_layer.lora_A" in keys
    _check_merge(tmp_path, tok, close)
