"""get_peft_model (targets, patching, gradient checkpointing), mode switches, and adapter round
trips with stock PEFT in both directions (dense and 4-bit bases)."""

from __future__ import annotations

import json

import pytest
import torch

from lorafuse import FastLanguageModel
from lorafuse.models import grad_checkpointing
from lorafuse.models.fast_model import LLAMA_PROJECTIONS
from lorafuse.models.nf4 import Linear4bit, NF4Weight
from lorafuse.testing import PLAIN, assert_as_accurate_as_stock, fp32_oracle, save_tiny_model

IDS = torch.tensor([[1, 5, 9, 17, 33, 40, 7, 2], [1, 6, 6, 21, 30, 11, 8, 2]])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(path, **PLAIN)
    return path


def _peft(model_dir, **kw):
    model, _ = FastLanguageModel.from_pretrained(
        str(model_dir), load_in_4bit=kw.pop("load_in_4bit", False)
    )
    return FastLanguageModel.get_peft_model(model, **kw)


def _randomise_adapters(model, seed=0):
    """LoRA B starts at zero (adapter = no-op); give every adapter weight a real value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_default_targets_patched_and_reported(tiny_model_dir, capsys):
    model = _peft(tiny_model_dir, r=4)
    err = capsys.readouterr().err
    assert "patched 14 of 14" in err, err
    cfg = model.peft_config["default"]
    assert sorted(cfg.target_modules) == sorted(LLAMA_PROJECTIONS)
    assert model.max_seq_length == 2048


def test_all_linear_and_bad_targets(tiny_model_dir):
    model = _peft(tiny_model_dir, r=4, target_modules="all-linear")
    targets = {t.rsplit(".", 1)[-1] for t in model.peft_config["default"].target_modules}
    assert targets == set(LLAMA_PROJECTIONS)  # every projection, not lm_head
    base, _ = FastLanguageModel.from_pretrained(str(tiny_model_dir))
    with pytest.raises(ValueError, match="qkv_proj"):
        FastLanguageModel.get_peft_model(base, target_modules=["qkv_proj"])


def test_4bit_base_is_a_lora_target_and_patched_sees_nf4(tiny_model_dir, capsys):
    model = _peft(tiny_model_dir, r=4, load_in_4bit=True)
    assert "patched 14 of 14" in capsys.readouterr().err
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, Linear4bit)
    assert isinstance(layer.base_layer.weight, NF4Weight)
    assert layer.lora_A["default"].weight.dtype == torch.float32


def _loss_and_grads(model):
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("mode", [True, "offload"])
def test_gradient_checkpointing_keeps_loss_and_grads(tiny_model_dir, mode, close):
    plain = _peft(tiny_model_dir, r=4, use_gradient_checkpointing=False)
    ckpt = _peft(tiny_model_dir, r=4, use_gradient_checkpointing=mode)
    ckpt.load_state_dict(plain.state_dict())
    _randomise_adapters(plain)
    _randomise_adapters(ckpt)
    assert grad_checkpointing.mode_of(ckpt) is True  # on CPU "offload" works as True
    assert ckpt.get_base_model().is_activation_checkpointing
    loss0, g0 = _loss_and_grads(plain)
    loss1, g1 = _loss_and_grads(ckpt)
    # Recomputation repeats the same fp32 kernels on the same inputs: bit-identical on CPU.
    close(loss1, loss0, atol=0, rtol=0, name="loss")
    for name in g0:
        close(g1[name], g0[name], atol=0, rtol=0, name=name)


def test_gradient_checkpointing_saves_activation_memory(tmp_path):
    save_tiny_model(tmp_path, **PLAIN, num_hidden_layers=4)
    ids = torch.randint(5, 128, (2, 64))
    saved = {}
    for mode in (False, True):
        model = _peft(tmp_path, r=4, use_gradient_checkpointing=mode)
        saved[mode] = grad_checkpointing.measure_activation_memory(model, ids)
    # Only the 4 layer inputs (B*T*hidden fp32 = 32 KiB each) plus the head stay saved; measured
    # ~7x less here. 1/3 fails if any layer is not checkpointed.
    assert saved[True] < saved[False] / 3, saved


def test_for_inference_and_for_training(tiny_model_dir):
    model = _peft(tiny_model_dir, r=4)
    hf = model.get_base_model()
    FastLanguageModel.for_inference(model)
    assert not model.training and not hf.is_activation_checkpointing and hf.config.use_cache
    out = model.generate(input_ids=IDS[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)
    FastLanguageModel.for_training(model)
    assert model.training and hf.is_activation_checkpointing and not hf.config.use_cache


# The round trips below run under both CPU branches: the auto dtype is bf16 where the CPU has
# native bf16 (compared through an fp32 oracle) and fp32 where it does not (compared directly).


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_saved_adapter_loads_in_stock_peft_identically(
    tiny_model_dir, tmp_path, load_in_4bit, cpu_low_precision, close
):
    from peft import PeftModel

    ours = _peft(tiny_model_dir, r=4, load_in_4bit=load_in_4bit, use_gradient_checkpointing=False)
    _randomise_adapters(ours)
    ours.eval()
    ours.save_pretrained(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == sorted(LLAMA_PROJECTIONS)
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    base, _ = FastLanguageModel.from_pretrained(str(tiny_model_dir), load_in_4bit=load_in_4bit)
    assert base.dtype == (torch.bfloat16 if cpu_low_precision == "native" else torch.float32)
    stock = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()  # not patched
    with torch.no_grad():
        # fp32: same math, different summation order (~1e-7 relative per op)
        got, want = ours(IDS).logits, stock(IDS).logits
        oracle = fp32_oracle(stock)(IDS).logits if got.dtype != torch.float32 else None
    assert_as_accurate_as_stock(got, want, oracle, name="logits", close=close)


def test_stock_peft_adapter_loads_into_lorafuse_identically(
    tiny_model_dir, tmp_path, cpu_low_precision, close
):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorafuse import patch_peft_model

    trained = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"]),
    ).eval()
    _randomise_adapters(trained, seed=1)
    trained.save_pretrained(tmp_path / "stock")
    base, _ = FastLanguageModel.from_pretrained(str(tiny_model_dir))  # the auto dtype
    ours = patch_peft_model(PeftModel.from_pretrained(base, tmp_path / "stock")).eval()
    assert "patched 6 of 6" in str(ours.lorafuse_report)
    stock_base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=base.dtype)
    stock = PeftModel.from_pretrained(stock_base, tmp_path / "stock").eval()
    with torch.no_grad():
        got, want = ours(IDS).logits, stock(IDS).logits
        oracle = fp32_oracle(stock)(IDS).logits if got.dtype != torch.float32 else None
    assert_as_accurate_as_stock(got, want, oracle, name="logits", close=close)
