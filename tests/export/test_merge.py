"""Streaming merge: merged logits == base + adapter logits; output is a stock HF sharded dir."""

from __future__ import annotations

import json

import pytest
import torch

from lorafuse.commands import main
from lorafuse.errors import LorafuseError
from lorafuse.export.merge import merge_adapter
from lorafuse.testing import chat_tokenizer, save_tiny_adapter, save_tiny_model
from lorafuse.testing.arch_families import ARCH_CASES, save_arch_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    save_tiny_model(root / "base")
    save_tiny_adapter(root / "base", root / "adapter", r=4)
    return root


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_merged_logits_match_peft(tiny, close):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = merge_adapter(tiny / "base", tiny / "adapter", tiny / "merged", max_shard_size="30KB")
    base = AutoModelForCausalLM.from_pretrained(tiny / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tiny / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(
        0, merged.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)
    )
    ref = _logits(peft_model, ids)
    with peft_model.disable_adapter():
        assert (
            ref - _logits(peft_model, ids)
        ).abs().max() > 1e-2  # the adapter does change outputs
    # fp32 merge: (x W^T + s x A^T B^T) vs x (W + s B A)^T differ only by summation order (~1e-6 rel).
    close(_logits(merged, ids), ref, atol=1e-4, rtol=1e-4, name="merged logits")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_merge_bf16_output_and_cli(tiny, close):
    from transformers import AutoModelForCausalLM

    rc = main(["merge", "--model", str(tiny / "base"), "--adapter", str(tiny / "adapter"),
               "-o", str(tiny / "m16"), "--dtype", "bfloat16"])  # fmt: skip
    assert rc == 0
    m16 = AutoModelForCausalLM.from_pretrained(tiny / "m16", dtype=torch.float32)
    m32 = AutoModelForCausalLM.from_pretrained(tiny / "merged", dtype=torch.float32)
    for (n, a), (_, b) in zip(m16.named_parameters(), m32.named_parameters()):
        # bf16 storage of the fp32-merged weight: one rounding, relative error <= 2^-8.
        close(a, b, atol=1e-6, rtol=2**-8, name=n)


def test_merge_refuses_existing_output_and_bad_adapter(tiny, tmp_path):
    with pytest.raises(LorafuseError, match="exists"):
        merge_adapter(tiny / "base", tiny / "adapter", tiny / "merged")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(
        json.dumps({"peft_type": "IA3", "r": 4, "lora_alpha": 8})
    )
    with pytest.raises(LorafuseError, match="peft_type 'IA3' is not LoRA"):
        merge_adapter(tiny / "base", bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dora_merge_matches_peft_merge_and_unload(tiny, tmp_path, close):
    """DoRA: the magnitude folded in fp32; stock PEFT's merge_and_unload is the oracle."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorafuse.export.merge import dora_reason

    base = AutoModelForCausalLM.from_pretrained(tiny / "base", dtype=torch.float32)
    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True,
                     rank_pattern={"down_proj": 2}, use_rslora=True, init_lora_weights=False)  # fmt: skip
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # trained-looking magnitudes (init: exactly the row norms)
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.rand_like(p))
    model.save_pretrained(tmp_path / "dora")
    assert dora_reason(tmp_path / "dora") and "DoRA" in dora_reason(tmp_path / "dora")
    assert dora_reason(tiny / "adapter") is None
    out = merge_adapter(tiny / "base", tmp_path / "dora", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_pretrained(tiny / "base", dtype=torch.float32)
    oracle = PeftModel.from_pretrained(fresh, tmp_path / "dora").merge_and_unload()
    changed = 0
    for (n, a), (_, b) in zip(merged.named_parameters(), oracle.named_parameters()):
        close(a, b, atol=1e-5, rtol=1e-5, name=n)
        changed += "q_proj" in n or "down_proj" in n
    assert changed == 2 * merged.config.num_hidden_layers
    orig = AutoModelForCausalLM.from_pretrained(tiny / "base", dtype=torch.float32)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged.state_dict()[q] - orig.state_dict()[q]).abs().max() > 1e-3  # really changed


def test_qlora_checkpoint_merges_into_original_precision_base(tiny, tmp_path):
    """A 4-bit training run's checkpoint merges into the base dir's dense weights (never NF4)."""
    import shutil

    from safetensors.torch import load_file

    ckpt = tmp_path / "final"
    shutil.copytree(tiny / "adapter", ckpt)
    cfg = {"model": str(tiny / "base"), "load_in_4bit": True, "max_seq_length": 128, "dtype": None}
    (ckpt / "lorafuse_config.json").write_text(json.dumps(cfg))
    assert (
        main(
            [
                "merge",
                "--checkpoint",
                str(ckpt),
                "-o",
                str(tmp_path / "m"),
                "--max-shard-size",
                "30KB",
            ]
        )
        == 0
    )
    got = {k: v for f in (tmp_path / "m").glob("*.safetensors") for k, v in load_file(f).items()}
    want = {k: v for f in (tiny / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float32 for k in got)


def test_merge_keeps_the_gguf_source_marker(tiny, tmp_path):
    """A base converted from GGUF names its source file; the merged dir keeps that, so a GGUF
    export of base + adapter carries the source's pre-tokenizer over (as llama.cpp's converter)."""
    import shutil

    from lorafuse.models.source import SOURCE_MARKER

    base = tmp_path / "base"
    shutil.copytree(tiny / "base", base)
    (base / SOURCE_MARKER).write_text(json.dumps({"source": "/models/x.gguf"}))
    out = merge_adapter(base, tiny / "adapter", tmp_path / "merged")
    assert json.loads((out / SOURCE_MARKER).read_text()) == {"source": "/models/x.gguf"}


@pytest.mark.parametrize("arch", sorted(ARCH_CASES))
def test_every_family_merges_to_the_peft_model_s_logits(arch, tmp_path, close):
    """Each architecture's own layout (Qwen2's biases, Gemma's norms, Phi-3's fused qkv_proj /
    gate_up_proj) merges to the unmerged PEFT model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tok = chat_tokenizer()
    save_arch_model(arch, tmp_path / "base", tok)
    save_tiny_adapter(tmp_path / "base", tmp_path / "adapter", target_modules=ARCH_CASES[arch][2])
    merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(0, len(tok), (2, 17), generator=torch.Generator().manual_seed(0))
    ref = _logits(peft_model, ids)
    with peft_model.disable_adapter():
        assert (ref - _logits(peft_model, ids)).abs().max() > 1e-2  # the adapter matters
    # as test_merged_logits_match_peft: fp32 summation order only
    close(_logits(merged, ids), ref, atol=1e-4, rtol=1e-4, name=f"{arch} merged logits")
