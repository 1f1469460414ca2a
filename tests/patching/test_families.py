"""Every family the registry names, fp32 against stock transformers + PEFT on tiny configs.

One forward/backward per family (with padding, so masks matter; longer than the sliding window
and, for Llama 3.x, longer than ``original_max_position_embeddings``): the loss and every LoRA
gradient within fp32 1e-5, the report naming exactly the fast paths applied, and the merged
model's logits equal to the unmerged ones. bf16 against the fp32 oracle for the partly fused
families (Phi-3, Gemma 3).
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from lorafuse import patch_peft_model
from lorafuse.testing import assert_close, count_calls
from lorafuse.testing.numerics import bf16_stock_of

VOCAB = 128
SEQ = 24
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _build(arch: str):
    import transformers as tf

    if arch == "llama3":  # llama3 rope scaling, tied embeddings, sequence past the original 16
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=16)  # fmt: skip
        cfg = tf.LlamaConfig(**SMALL, tie_word_embeddings=True, rope_scaling=scaling)
        return tf.LlamaForCausalLM(cfg)
    if arch == "qwen2":  # q/k/v biases
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, tie_word_embeddings=False))
    if arch == "smollm3":  # NoPE on every other layer
        cfg = tf.SmolLM3Config(**SMALL, no_rope_layers=[1, 0], tie_word_embeddings=True)
        return tf.SmolLM3ForCausalLM(cfg)
    if arch == "phi3":  # fused qkv_proj / gate_up_proj, partial rotary
        return tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, partial_rotary_factor=0.5))
    if arch == "gemma2":  # soft-capping (attention and final), sliding window shorter than SEQ
        # final soft-capping at 0.3 bends the tiny model's logits (std 0.16): loss -0.015 vs
        # uncapped (the default 30 would change it by 2e-6, below the test's tolerance)
        cfg = tf.Gemma2Config(**SMALL, head_dim=16, sliding_window=8, final_logit_softcapping=0.3)
        return tf.Gemma2ForCausalLM(cfg)
    if arch == "gemma3_text":  # q/k norms, sliding layers with their own rope, no soft-capping;
        # query_pre_attn_scalar 256 (the default) != head_dim 16, as 27B's 168 != 128
        cfg = tf.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        return tf.Gemma3ForCausalLM(cfg)
    raise ValueError(arch)


# What each family must get (fast-path name prefixes) and must not.
EXPECTED = {
    "llama3": {"llama.rms_norm", "llama.mlp", "llama.attention", "llama.causal_lm_loss"},
    "qwen2": {"qwen2.rms_norm", "qwen2.mlp", "qwen2.attention", "qwen2.causal_lm_loss"},
    "smollm3": {"smollm3.rms_norm", "smollm3.mlp", "smollm3.attention", "smollm3.causal_lm_loss"},
    "phi3": {"phi3.rms_norm", "phi3.mlp", "phi3.attention", "phi3.causal_lm_loss"},
    "gemma2": {"gemma2.rms_norm", "gemma2.mlp", "gemma2.attention", "gemma2.causal_lm_loss"},
    "gemma3_text": {"gemma3.rms_norm", "gemma3.mlp", "gemma3.attention", "gemma3.causal_lm_loss"},
}


def _pair(arch, seed=0, model=None):
    torch.manual_seed(seed)
    targets = PHI if arch == "phi3" else ALL7
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    stock = peft.get_peft_model((model or _build(arch)).float(), cfg)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():  # PEFT zero-inits B: randomise it so every gradient path is non-trivial
        for name, p in stock.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return stock


def _batch(seq=SEQ):
    g = torch.Generator().manual_seed(1000)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, seq - 5 :] = 0  # right padding on row 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def _unpadded(seq=SEQ):  # no mask: the causal-attention kernel's case
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1001))
    return dict(input_ids=ids, labels=ids)


def _loss_and_grads(model, batch):
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.item(), grads


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_fp32_loss_and_every_lora_gradient_match_stock(arch):
    stock = _pair(arch)
    fused = patch_peft_model(copy.deepcopy(stock), backend="auto")
    report = fused.lorafuse_report
    got = {k.split("[")[0] for k in report.fast_paths}
    assert got == EXPECTED[arch], (got, str(report))
    assert report.n_patched == report.n_lora > 0, str(report)
    for batch in (_batch(), _unpadded()):
        ls, gs = _loss_and_grads(stock, batch)
        lf, gf = _loss_and_grads(fused, batch)
        assert abs(lf - ls) <= 1e-5 * max(1.0, abs(ls)), (arch, lf, ls)  # fp32 reordering only
        assert gf.keys() == gs.keys() and any("lora_A" in n for n in gs)
        for n, g in gs.items():
            assert_close(gf[n], g, atol=1e-5, rtol=1e-4, name=f"{arch} {n}")


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3_text"])
def test_report_says_why_each_part_stays_stock(arch):
    report = patch_peft_model(_pair(arch)).lorafuse_report
    notes = "\n".join(report.notes)
    prefix = "phi3" if arch == "phi3" else arch
    if arch == "phi3":
        assert f"{prefix} attention: lora_qkv on qkv_proj's row blocks" in notes, notes
    if arch.startswith("gemma"):
        assert f"{prefix} attention: lora_qkv" in notes and "query_pre_attn_scalar" in notes, notes
        assert f"{prefix} mlp: lora_mlp with the GeGLU (gelu-tanh) activation" in notes, notes
        assert "fused cross-entropy not applied" not in notes, notes  # soft-capping included


@pytest.mark.parametrize("arch", ["llama3", "phi3", "gemma3_text"])
def test_merged_model_equals_unmerged(arch):
    fused = patch_peft_model(_pair(arch))
    fused.eval()
    ids = _batch()["input_ids"]
    with torch.no_grad():
        before = fused(input_ids=ids).logits
        merged = fused.merge_and_unload()
        after = merged(input_ids=ids).logits
    assert_close(after, before, atol=1e-5, rtol=1e-4, name=f"{arch} merged logits")


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3_text", "smollm3"])
def test_bf16_is_no_less_accurate_than_stock_bf16(arch):
    """As in test_fast_paths: bf16 base + fp32 adapters against an fp32 oracle on the same weights."""
    oracle = _pair(arch)
    stock = bf16_stock_of(oracle)
    fused = patch_peft_model(copy.deepcopy(stock), backend="auto")
    if arch.startswith("gemma"):  # Gemma rounds its (1 + w) norm once, after the weight: so does
        # the fused norm (round_once), on bf16 weights too
        assert any("rms_norm[1+w" in k for k in fused.lorafuse_report.fast_paths)
    b = _batch()
    l32, g32 = _loss_and_grads(oracle, b)
    ls, gs = _loss_and_grads(stock, b)
    lf, gf = _loss_and_grads(fused, b)

    def err(g):
        return max(((g[n] - g32[n]).norm() / g32[n].norm()).item() for n in g32)

    # Same bound and reason as test_fast_paths': bf16 eps 7.8e-3, different rounding points.
    assert abs(lf - l32) <= 2 * abs(ls - l32) + 2e-3, (lf, ls, l32)
    assert err(gf) <= 2 * err(gs) + 2e-3, (err(gf), err(gs))


def test_phi3_mlp_runs_lora_mlp_and_dropout_takes_the_lora_linear_with_a_warning(monkeypatch):
    from lorafuse.patching import fused_forwards

    calls = count_calls(monkeypatch, fused_forwards, "lora_mlp")
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.2, target_modules=PHI)
    stock = peft.get_peft_model(_build("phi3"), cfg)
    fused = patch_peft_model(copy.deepcopy(stock))
    fused.eval()
    with torch.no_grad():
        fused(input_ids=_batch()["input_ids"])
    assert len(calls) == 2  # one per layer: the fused MLP without dropout (eval)
    fused.train()
    stock.train()
    torch.manual_seed(5)  # same dropout masks
    out = [_loss_and_grads(stock, _batch())]
    torch.manual_seed(5)
    with pytest.warns(RuntimeWarning, match="lora_dropout > 0: fused MLP not used"):
        out.append(_loss_and_grads(fused, _batch()))
    assert abs(out[1][0] - out[0][0]) <= 1e-5 * abs(out[0][0])
    for n, g in out[0][1].items():
        assert_close(out[1][1][n], g, atol=1e-5, rtol=1e-4, name=n)


def test_gemma3_attention_kernel_is_scaled_by_query_pre_attn_scalar(monkeypatch):
    """The fused attention scales by query_pre_attn_scalar^-0.5 (Gemma 3 27B: 168, not its
    head_dim 128), on the causal kernel's path too (the unpadded batch of the fp32 test)."""
    from lorafuse.patching import attention

    scales = []
    original = attention.causal_attention

    def recording(q, k, v, scale, **kwargs):
        scales.append(scale)
        return original(q, k, v, scale, **kwargs)

    monkeypatch.setattr(attention, "causal_attention", recording)
    fused = patch_peft_model(_pair("gemma3_text"), backend="auto")
    with torch.no_grad():
        fused(**_unpadded())
    if not scales:
        pytest.skip("no causal-attention kernel on this machine (the model's interface ran)")
    assert set(scales) == {256**-0.5}  # not head_dim 16's 0.25


def _phi3(**config):
    import transformers as tf

    torch.manual_seed(0)
    return tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, **config))


# Phi-3 attention variants: full rotary (Phi-3-mini), and longrope scaling (Phi-3-mini-128k / Phi-4
# mini style) with a sequence past original_max_position_embeddings so the long factors apply.
_LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=16,
                 short_factor=[1.0 + 0.1 * i for i in range(4)],
                 long_factor=[2.0 + 0.5 * i for i in range(4)])  # fmt: skip
PHI3_VARIANTS = {
    "full_rotary": dict(partial_rotary_factor=1.0),
    "longrope_partial": dict(partial_rotary_factor=0.5, rope_scaling=_LONGROPE),
}


@pytest.mark.parametrize("variant", list(PHI3_VARIANTS))
def test_phi3_attention_runs_lora_qkv_on_qkv_proj_blocks_and_matches_stock(variant, monkeypatch):
    from lorafuse.patching import attention

    calls = count_calls(monkeypatch, attention, "lora_qkv")
    stock = _pair("phi3", model=_phi3(**PHI3_VARIANTS[variant]))
    fused = patch_peft_model(copy.deepcopy(stock), backend="auto")
    assert "phi3.attention[lora_qkv+rope+causal_attention]" in fused.lorafuse_report.fast_paths
    for batch in (_batch(), _unpadded()):
        ls, gs = _loss_and_grads(stock, batch)
        lf, gf = _loss_and_grads(fused, batch)
        assert abs(lf - ls) <= 1e-5 * max(1.0, abs(ls)), (variant, lf, ls)
        for n, g in gs.items():
            assert_close(gf[n], g, atol=1e-5, rtol=1e-4, name=f"{variant} {n}")
    assert len(calls) == 2 * 2  # two layers, two batches: every attention through lora_qkv


def test_phi3_generation_equals_stock_greedy():
    stock = _pair("phi3", model=_phi3(partial_rotary_factor=0.5))
    fused = patch_peft_model(copy.deepcopy(stock), backend="auto")
    ids = _unpadded()["input_ids"][:, :8]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = stock.generate(input_ids=ids, **kw)
        got = fused.generate(input_ids=ids, **kw)
    assert torch.equal(got, want)
