"""Llama-family fast paths: stock transformers + PEFT vs lorafuse, step for step.

Tiny configs of llama / mistral / qwen2 / qwen3 trained 30 AdamW steps from the same seed on the
same batches (with padding, so masks matter): the loss at every step, the final adapter weights
and greedy generation must agree.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from lorafuse import patch_peft_model, unpatch_peft_model
from lorafuse.backends import KERNELS
from lorafuse.patching import attention as attention_forwards
from lorafuse.testing import assert_close, available_backends, tiny_llama_config
from lorafuse.testing.numerics import bf16_stock_of

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 128
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=False,
)  # fmt: skip


def _build(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaForCausalLM(tiny_llama_config())
    if arch == "mistral":  # a window shorter than the sequence, so the sliding mask is exercised
        return tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=8))
    if arch == "qwen2":  # q/k/v carry biases
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL))
    if arch == "qwen3":  # q/k norms; head_dim set explicitly (its default is 128)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=16))
    raise ValueError(arch)


def _pair(arch, dropout=0.0, targets=ALL7, seed=0, backend="torch"):
    torch.manual_seed(seed)
    base = _build(arch)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=targets)
    stock = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():  # PEFT zero-inits B: randomise it so every gradient path is non-trivial
        for name, p in stock.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    fused = patch_peft_model(copy.deepcopy(stock), backend=backend)
    return stock, fused


def _batch(step, batch=2, seq=16):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, seq - 5 :] = 0  # right padding on row 1
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _train(model, steps, lr=1e-3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        torch.manual_seed(step)  # same dropout masks for stock and fused
        loss = model(**_batch(step)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _adapter_rel_diff(a, b):
    wb = dict(b.named_parameters())
    return max(
        ((p - wb[n]).norm() / wb[n].norm()).item() for n, p in a.named_parameters() if "lora_" in n
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_30_steps_match_stock_and_generate_identically(arch):
    stock, fused = _pair(arch)
    fp = fused.lorafuse_report.fast_paths
    assert any("attention" in k for k in fp) and any("mlp" in k for k in fp), fp
    assert any("rms_norm" in k for k in fp) and any("causal_lm_loss" in k for k in fp), fp
    ls, lf = _train(stock, 30), _train(fused, 30)
    for step, (a, b) in enumerate(zip(lf, ls)):
        # fp32: the fused ops reorder sums (chunked log-sum-exp, bracketed LoRA backward), a few
        # ulps per op; Adam turns that into ~1e-5 relative weight drift over 30 steps (see
        # test_peft_lora), which moves a ~4.8 loss by < 1e-4 absolute.
        assert abs(a - b) <= 1e-4 + 1e-5 * abs(b), f"{arch} step {step}: fused {a} vs stock {b}"
    assert ls[-1] < ls[0], "training did not reduce the loss: the comparison is vacuous"
    rel = _adapter_rel_diff(fused, stock)
    assert rel < 1e-4, f"{arch}: final adapters differ by {rel:.2e} (relative Frobenius)"
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    stock.eval()
    fused.eval()
    with torch.no_grad():
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(
            fused.generate(input_ids=prompt, **kw), stock.generate(input_ids=prompt, **kw)
        )


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_grads_and_dropout_match_stock(arch, backend):
    stock, fused = _pair(arch, dropout=0.2, backend=backend)
    out = {}
    for tag, m in (("stock", stock), ("fused", fused)):
        torch.manual_seed(5)
        loss = m(**_batch(0)).loss
        loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        out[tag] = (loss.detach(), grads)
    # fp32, one step: ulp-level reordering only (see test_peft_lora).
    assert_close(out["fused"][0], out["stock"][0], atol=1e-5, rtol=1e-5, name="loss")
    assert out["fused"][1].keys() == out["stock"][1].keys()
    for n, g in out["stock"][1].items():
        assert_close(out["fused"][1][n], g, atol=1e-5, rtol=1e-4, name=n)


ATTENTION_BACKENDS = [b for b in available_backends() if "attention" in KERNELS.get(b, ())]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_unpadded_batches_use_the_attention_kernel_and_match_stock(arch, backend, monkeypatch):
    """No mask tensor: the fused model attends through causal_attention (except Mistral, whose
    8-token window is shorter than the batch) and still matches stock loss and gradients."""
    calls = []
    real = attention_forwards.causal_attention
    monkeypatch.setattr(
        attention_forwards, "causal_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    stock, fused = _pair(arch, backend=backend)
    batch = _batch(0)
    batch = dict(input_ids=batch["input_ids"], labels=batch["input_ids"])
    out = {}
    for tag, m in (("stock", stock), ("fused", fused)):
        loss = m(**batch).loss
        loss.backward()
        out[tag] = (
            loss.detach(),
            {n: p.grad for n, p in m.named_parameters() if p.grad is not None},
        )
    assert len(calls) == (0 if arch == "mistral" else 2)  # one per layer
    # fp32, one step: ulp-level reordering only (see test_peft_lora).
    assert_close(out["fused"][0], out["stock"][0], atol=1e-5, rtol=1e-5, name="loss")
    for n, g in out["stock"][1].items():
        assert_close(out["fused"][1][n], g, atol=1e-5, rtol=1e-4, name=n)
    # Generation: the prefill (empty KV cache, 5 queries) attends through the kernel too.
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    stock.eval()
    fused.eval()
    with torch.no_grad():
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        want = stock.generate(input_ids=prompt, **kw)
        before = len(calls)
        assert torch.equal(fused.generate(input_ids=prompt, **kw), want)
    assert len(calls) - before == 2  # the prefill only (5 tokens fit Mistral's window too)


def test_sequences_past_the_crossover_take_the_models_own_attention(monkeypatch):
    """Under auto, a batch longer than ``AUTO_MAX_LENGTH`` (torch's flash kernel measured faster
    there) never enters causal_attention: the model's own interface runs, as in stock."""
    from lorafuse.ops import attention

    if "cpp" not in ATTENTION_BACKENDS:
        pytest.skip("C++ extension not built here")
    calls = []
    real = attention_forwards.causal_attention
    monkeypatch.setattr(
        attention_forwards, "causal_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    monkeypatch.setattr(attention, "AUTO_MAX_LENGTH", {"fp32": 8, "native low precision": 8})
    stock, fused = _pair("llama", backend="auto")
    for seq, want_calls in ((8, 2), (9, 0)):  # two layers
        ids = _batch(0, seq=seq)["input_ids"]
        calls.clear()
        loss = fused(input_ids=ids, labels=ids).loss
        assert len(calls) == want_calls, seq
        assert_close(loss, stock(input_ids=ids, labels=ids).loss, atol=1e-5, rtol=1e-5, name="loss")


def test_patching_asks_the_op_which_attention_kernel_runs():
    """``ops.attention.kernel`` (the length rule, then ``backends.select``) is the one choice of
    attention's kernel: no patching module selects it or applies the length rule itself."""
    from pathlib import Path

    for path in Path(attention_forwards.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert 'select("attention"' not in text, f"{path.name} selects attention's kernel"
        assert "auto_prefers_torch" not in text, f"{path.name} applies the length rule itself"


def test_disable_adapter_and_logits_without_labels():
    stock, fused = _pair("llama")
    b = _batch(0)
    with torch.no_grad():
        with stock.disable_adapter():
            base_s = stock(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        with fused.disable_adapter():
            base_f = fused(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        lf = fused(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        ls = stock(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert_close(base_f, base_s, atol=1e-5, rtol=1e-5, name="adapters disabled")
    assert_close(lf, ls, atol=1e-5, rtol=1e-5, name="logits")
    assert not torch.allclose(lf, base_f), "adapter had no effect: test is vacuous"


def test_fused_loss_returns_no_logits_and_honours_num_items_in_batch():
    stock, fused = _pair("llama")
    b = _batch(3)
    n_items = torch.tensor(40)  # e.g. the token count of a whole accumulated batch
    ls = stock(**b, num_items_in_batch=n_items)
    lf = fused(**b, num_items_in_batch=n_items)
    assert lf.logits is None
    assert_close(lf.loss, ls.loss, atol=1e-5, rtol=1e-5, name="loss / num_items_in_batch")
    with torch.no_grad():  # evaluation keeps logits
        assert fused(**b).logits is not None


def test_lm_head_lora_still_trains_and_is_reported():
    stock, fused = _pair("llama", targets=[*ALL7, "lm_head"])
    report = fused.lorafuse_report
    assert any("lm_head carries LoRA" in n for n in report.notes), str(report)
    loss = fused(**_batch(0)).loss
    loss.backward()
    head = [p for n, p in fused.named_parameters() if "lm_head.lora_A" in n]
    assert head and head[0].grad is not None and head[0].grad.abs().sum() > 0


def test_report_names_fast_paths_and_unpatch_restores():
    stock, fused = _pair("qwen2")
    text = str(fused.lorafuse_report)
    assert "patched 14 of 14 LoRA modules" in text and "qwen2" in text
    unpatch_peft_model(fused)
    assert not any("forward" in m.__dict__ for m in fused.modules())
    b = _batch(0)
    with torch.no_grad():
        assert torch.equal(fused(**b).logits, stock(**b).logits)


def test_other_architecture_gets_generic_patch_and_a_note():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)  # fmt: skip
    model = peft.get_peft_model(
        GPTNeoXForCausalLM(cfg), peft.LoraConfig(r=2, target_modules=["query_key_value", "dense"])
    )
    report = patch_peft_model(model).lorafuse_report
    assert report.n_patched == report.n_lora > 0 and not report.fast_paths
    assert any("gpt_neox" in n for n in report.notes)


def _loss_and_grads(model, batch):
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_is_no_less_accurate_than_stock_bf16(arch):
    """bf16 base + fp32 adapters (PEFT's default autocast_adapter_dtype): against an fp32 oracle
    computed from the same (bf16-representable) weights, the fused model's error must not be
    materially worse than stock PEFT's own bf16 error."""
    oracle, _ = _pair(arch)
    stock = bf16_stock_of(oracle)
    fused = patch_peft_model(copy.deepcopy(stock), backend="auto")
    b = _batch(0)
    l32, g32 = _loss_and_grads(oracle, b)
    ls, gs = _loss_and_grads(stock, b)
    lf, gf = _loss_and_grads(fused, b)

    def err(g):
        return max(((g[n] - g32[n]).norm() / g32[n].norm()).item() for n in g32)

    # bf16 keeps 8 mantissa bits (eps 7.8e-3): both paths round activations at different
    # points, so neither is bitwise the other; "2x stock's error + 2e-3" allows a different
    # rounding order but fails a real precision loss (e.g. dropping the fp32 adapter math).
    assert abs(lf - l32) <= 2 * abs(ls - l32) + 2e-3, (lf, ls, l32)
    assert err(gf) <= 2 * err(gs) + 2e-3, (err(gf), err(gs))


def test_gradient_checkpointing_matches_stock():
    stock, fused = _pair("llama")
    for m in (stock, fused):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ls, gs = _loss_and_grads(stock, _batch(0))
    lf, gf = _loss_and_grads(fused, _batch(0))
    assert abs(lf - ls) <= 1e-5 * abs(ls), (lf, ls)  # fp32, ulp-level reordering only
    for n, g in gs.items():
        assert_close(gf[n], g, atol=1e-5, rtol=1e-4, name=n)


def test_report_shows_the_kernel_choices_made_at_the_first_forward():
    """RMSNorm, attention and the LoRA kernels choose at the first forward pass: the report reads
    ``backends.choices()`` live, so printed after a step it names each op's implementation."""
    _, fused = _pair("llama", backend="auto")
    batch = _batch(0)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])  # unpadded: the attention kernel
    fused(**batch).loss.backward()
    report = fused.lorafuse_report
    for op in ("lora_linear", "rms_norm", "rope", "attention", "cross_entropy"):
        assert f"{op} (cpu)" in report.kernels, op
    text = str(report)
    assert "kernels chosen so far:" in text and "rms_norm (cpu): " in text
    assert report.to_dict()["kernels"] == report.kernels
