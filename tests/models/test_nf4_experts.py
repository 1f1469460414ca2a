"""QLoRA on mixture-of-experts models: NF4 expert stacks, dequantised per expert by the fused
op, equal stock PEFT on the same (dequantised) weights; 4 bit where bf16 holds 16; PEFT's own
forward on the placeholders is refused, not silently wrong."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from lorafuse.errors import LorafuseError
from lorafuse.models import nf4_experts
from lorafuse.patching import moe, patch_peft_model
from lorafuse.testing import assert_close, op_cases
from lorafuse.testing.new_families import build_family_model

CASES = op_cases("moe_lora")


def _config(model):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip


def _quantized_pair(arch):
    """(NF4 model, dense model holding the NF4 experts' dequantised values)."""
    model = build_family_model(arch)
    nf4_experts.quantize_experts_(model, torch.float32)
    dense = build_family_model(arch)
    with torch.no_grad():
        for m, d in zip(model.modules(), dense.modules()):
            if moe.is_experts(m):
                for p in (moe.GATE_UP, moe.DOWN):
                    getattr(d, p).copy_(moe.expert_weight(m, p).dequantize(torch.float32))
    return model, dense


@pytest.mark.parametrize("backend, device", CASES)
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
def test_nf4_experts_train_as_stock_peft_on_their_values(arch, backend, device):
    model, dense = _quantized_pair(arch)
    stacks = [moe.expert_weight(m, p) for m in model.modules() if moe.is_experts(m)
              for p in (moe.GATE_UP, moe.DOWN)]  # fmt: skip
    assert stacks and all(isinstance(s, nf4_experts.NF4Experts) for s in stacks)
    bf16 = sum(s.shape.numel() * 2 for s in stacks)
    assert sum(s.nbytes() for s in stacks) < 0.3 * bf16  # 0.516 bytes a weight + scales
    torch.manual_seed(0)
    ours = patch_peft_model(peft.get_peft_model(model, _config(model)), backend=backend).train()
    stock = peft.get_peft_model(dense, _config(dense)).train()
    stock.load_state_dict(
        {k: v for k, v in ours.state_dict().items() if "lora_" in k}, strict=False
    )
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    o, s = ours(input_ids=ids, labels=ids), stock(input_ids=ids, labels=ids)
    assert_close(o.loss, s.loss, atol=1e-5, rtol=1e-5, name="loss")
    o.loss.backward()
    s.loss.backward()
    sp = dict(stock.named_parameters())
    grads = [(n, p.grad) for n, p in ours.named_parameters() if p.grad is not None]
    assert any(".experts." in n for n, _ in grads)
    for n, g in grads:
        assert_close(g, sp[n].grad, atol=1e-5 * float(sp[n].grad.abs().max()), rtol=1e-5, name=n)


def test_peft_forward_on_nf4_placeholders_is_refused():
    model, _ = _quantized_pair("Qwen3MoeForCausalLM")
    stock = peft.get_peft_model(model, _config(model))  # not patched: PEFT's own forward
    ids = torch.randint(3, 256, (1, 8))
    with pytest.raises(LorafuseError, match="NF4 expert weights run only through"):
        stock(input_ids=ids)


def test_nf4_experts_follow_to_and_deepcopy():
    model, _ = _quantized_pair("Qwen3MoeForCausalLM")
    ids = torch.randint(3, 256, (1, 8))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        copied = copy.deepcopy(model).to(torch.float32)
        assert_close(copied(input_ids=ids).logits, ref, atol=0, rtol=0, name="copy")


def test_load_in_4bit_quantises_experts_and_trains(tmp_path, capsys):
    from lorafuse import FastLanguageModel
    from lorafuse.testing import chat_tokenizer
    from lorafuse.testing.new_families import save_family_model

    save_family_model("GptOssForCausalLM", tmp_path, chat_tokenizer())
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path), load_in_4bit=True, dtype="float32")
    assert "4 expert stacks" in capsys.readouterr().err
    peft_model = FastLanguageModel.get_peft_model(model, r=4, use_gradient_checkpointing=False,
                                                  cpu_heap_policy=False)  # fmt: skip
    assert peft_model.lorafuse_report.fast_paths[moe.FAST_PATH] == 2
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for n, p in peft_model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(grads) == 4 and all(g.abs().sum() > 0 for g in grads)  # B starts at 0, A does not
