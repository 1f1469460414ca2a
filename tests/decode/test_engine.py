"""The decode engine (decode/engine.py, csrc/decode_engine.h) against transformers: each engine
family's greedy tokens and logits in fp32 (the MoE families' routing included), prefill in chunks, sliding windows, KV blocks that
grow, fork and are reused, and the families it leaves to the model's forward (reported)."""

from __future__ import annotations

import pytest
import torch

from lorafuse import backends, decode
from lorafuse.decode import engine as engine_mod
from lorafuse.generation import GenerationResult, SamplingParams, stream_generate
from lorafuse.testing.arch_families import ARCH_CASES, MORE_CASES, build_arch_model
from lorafuse.testing.new_families import build_family_model

pytestmark = pytest.mark.cpp
FAMILIES = ["LlamaForCausalLM", "MistralForCausalLM", "SmolLM3ForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
            "Olmo2ForCausalLM", "Olmo3ForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM",
            "Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
            "Lfm2ForCausalLM", "Lfm2MoeForCausalLM"]  # fmt: skip
# Phi-3 with a 16-token window and half of each head rotated (Phi-4-mini's partial rotary);
# Gemma 3 with one local and one global layer (its two RoPE tables, in 2 layers instead of 7)
OVERRIDES = {"Phi3ForCausalLM": {**ARCH_CASES["Phi3ForCausalLM"][1], "sliding_window": 16,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5}},
             "Gemma3ForCausalLM": {**ARCH_CASES["Gemma3ForCausalLM"][1], "num_hidden_layers": 2,
                                   "layer_types": ["sliding_attention", "full_attention"]},
             # 8 experts, top 2 not renormalised; layer 1 dense (mlp_only_layers)
             "Qwen3MoeForCausalLM": {**MORE_CASES["Qwen3MoeForCausalLM"][1], "num_experts": 8,
                                     "mlp_only_layers": [1], "norm_topk_prob": False},
             # short convolutions with their biases (in_proj, conv, out_proj)
             "Lfm2ForCausalLM": {**MORE_CASES["Lfm2ForCausalLM"][1], "conv_bias": True}}  # fmt: skip
OTHERS = ["GptOssForCausalLM"]  # no reader: attention sinks, biased transposed experts
PROMPTS = ["The quick brown fox jumps over", "hi", "a b c d e f g h i j k l m n o p q r s t u"]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def engine_greedy(engine, ids: list[int], n: int, adapter=None) -> list[int]:
    seq = engine.open(adapter, len(ids) + n)
    logits, out = engine.prefill(seq, ids), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.step([seq], [out[-1]])[0]
    engine.close(seq)
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_engine_is_transformers(arch, tok):
    """Greedy tokens equal model.generate's; every prompt position's logits equal the model's
    forward within fp32 summation error (a wrong norm, rope, bias or cache row is far off)."""
    model = build_arch_model(arch, tok, OVERRIDES.get(arch))
    engine = decode.DecodeEngine(model)
    assert engine.weights == "fp32" and engine.weight_bytes > 0
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        assert engine_greedy(engine, ids, 24) == hf_greedy(model, ids, 24)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        seq = engine.open(None, len(ids))
        got = engine.prefill(seq, ids, all_logits=True)
        engine.close(seq)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Lfm2ForCausalLM"])
def test_chunked_prefill_and_growing_blocks_change_nothing(arch, tok, monkeypatch):
    """Chunks of 5 tokens, each a step (LFM2: convolutions across the chunks' edges)."""
    model = build_arch_model(arch, tok)
    engine = decode.DecodeEngine(model)
    ids = tok(PROMPTS[2])["input_ids"]
    whole = engine.prefill(engine.open(None, len(ids)), ids, all_logits=True)
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 5)  # 5-token chunks, each a step
    seq = engine.open(None, 1)  # a block that must grow (doubling) during the prefill
    chunked = engine.prefill(seq, ids, all_logits=True)
    assert engine.cpp.capacity(seq.slot) >= len(ids)
    assert torch.equal(chunked, whole)  # each row's sums do not depend on the step's rows


def test_sliding_window_matches_transformers(tok):
    """Mistral with a 6-token window: a 30-token sequence attends to its last 6 only."""
    from lorafuse.testing.arch_families import SMALL

    model = build_arch_model("MistralForCausalLM", tok, {**SMALL, "num_hidden_layers": 2,
                                                          "sliding_window": 6})  # fmt: skip
    model.config._attn_implementation = "sdpa"
    engine = decode.DecodeEngine(model)
    assert all(layer.window == 6 for layer in engine.decoder.layers)
    ids = tok(PROMPTS[0])["input_ids"]
    assert engine_greedy(engine, ids, 24) == hf_greedy(model, ids, 24)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Lfm2ForCausalLM"])
def test_fork_copies_the_cache_and_slots_are_reused(arch, tok):
    """A fork holds its source's keys and values (LFM2: and convolution history)."""
    model = build_arch_model(arch, tok)
    engine = decode.DecodeEngine(model)
    ids = tok(PROMPTS[0])["input_ids"]
    seq = engine.open(None, len(ids) + 8)
    first = engine.prefill(seq, ids)
    twin = engine.fork(seq)
    assert twin.slot != seq.slot and twin.length == seq.length
    t = int(first.argmax())
    a, b = engine.step([seq, twin], [t, t])
    assert torch.equal(a, b)
    slot = twin.slot
    engine.close(twin)
    assert twin.slot == -1
    again = engine.open(None, 4)
    assert again.slot == slot  # a closed slot is the next one opened


@pytest.mark.parametrize("arch", OTHERS)
def test_other_families_take_the_model_forward_and_say_why(arch, tok):
    model = build_family_model(arch, tok)
    assert decode.engine_for(model) is None
    reason = decode.unavailable_reason(model)
    assert reason and "no decode-engine reader" in reason
    assert backends.choices()["decode_engine (cpu)"].startswith("model forward:")
    ids = tok(PROMPTS[0])["input_ids"]
    result = GenerationResult()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    out = []
    list(stream_generate(model, tok, ids, params, result=result,
                         on_token=lambda t, _: out.append(t)))  # fmt: skip
    assert out == hf_greedy(model, ids, 6)


def test_stream_generate_on_the_engine_equals_the_model_forward(tok):
    model = build_arch_model("Qwen2ForCausalLM", tok)
    ids = tok(PROMPTS[0])["input_ids"]
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, seed=3, ignore_eos=True)
    texts = []
    for engine in ("auto", None):
        result = GenerationResult()
        list(stream_generate(model, tok, ids, params, result=result, engine=engine))
        texts.append(result.text)
    assert decode.engine_for(model) is not None
    assert texts[0] == texts[1] and result.completion_tokens == 10
