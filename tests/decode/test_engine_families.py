"""The decode engine's non-Llama families with PEFT adapters: for Gemma 1/2/3, OLMo 2/3, Granite,
Phi-3 (adapters on its fused qkv / gate_up modules), Qwen3-MoE (adapters on attention) and LFM2
(adapters on its convolution layers' in_proj / out_proj too), one batch mixing two adapters and the
base, prompt lengths and stop points gives each row PEFT's greedy tokens and logits for that
adapter alone, in fp32; bf16 and int8 weights give the fp32 forward of the model with those
weights dequantized; and a family the engine cannot run says why in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lorafuse import decode
from lorafuse.decode import families
from lorafuse.models.resolve import use_adapter
from lorafuse.ops import quant_linear
from lorafuse.testing.arch_families import ARCH_CASES, ATTN, MLP, MORE_CASES, build_arch_model

pytestmark = pytest.mark.cpp
ARCHS = ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM",
         "Olmo3ForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM",
         "Lfm2ForCausalLM"]  # fmt: skip
TARGETS = {"Phi3ForCausalLM": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
           "Qwen3MoeForCausalLM": ATTN,
           "Lfm2ForCausalLM": ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2",
                               "w3"]}  # fmt: skip
# Gemma 3 with one local and one global layer (its two RoPE tables, in 2 layers instead of 7)
OVERRIDES = {"Gemma3ForCausalLM": {**ARCH_CASES["Gemma3ForCausalLM"][1], "num_hidden_layers": 2,
                                   "layer_types": ["sliding_attention", "full_attention"]},
             # top 2 of 8 experts renormalised (test_engine.py has them not renormalised); 3
             # layers: with 2, adapter b's greedy tokens are the base's
             "Qwen3MoeForCausalLM": {**MORE_CASES["Qwen3MoeForCausalLM"][1], "num_experts": 8,
                                     "norm_topk_prob": True, "num_hidden_layers": 3}}  # fmt: skip
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "hello", "0123",
           "a b c d e f g h i j k l m n o p q r s t u"]  # fmt: skip
# (adapter, prompt, new tokens): rows join at once and leave at their own lengths; the long
# prompt + 14 tokens passes the 16-token sliding windows; rows 2, 3, 5: one prompt, 3 adapters
ROWS = [(None, 0, 6), ("a", 1, 3), ("b", 3, 8), ("a", 3, 14), ("b", 0, 2), (None, 3, 10)]


def with_adapters(model, targets):
    """``model`` under PEFT with adapters a and b (random A and B: both change the outputs)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    configs = [LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
               for r in (4, 8)]  # fmt: skip
    peft = get_peft_model(model, configs[0], adapter_name="a")
    peft.add_adapter("b", configs[1])
    return peft.eval()


def peft_greedy(model, ids, n, adapter):
    with use_adapter(model, adapter), torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    return out[0, len(ids) :].tolist(), logits


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mixed_batch_gives_each_row_its_adapter(arch, tok):
    model = build_arch_model(arch, tok, OVERRIDES.get(arch))
    model = with_adapters(model, TARGETS.get(arch, ATTN + MLP))
    engine = decode.engine_for(model)
    assert engine is not None, decode.unavailable_reason(model)
    assert engine.adapters == ["a", "b"]
    ids = [tok(PROMPTS[p])["input_ids"] for _, p, _ in ROWS]
    seqs = [engine.open(a, len(i) + n) for (a, _, n), i in zip(ROWS, ids)]
    first = [engine.prefill(s, i) for s, i in zip(seqs, ids)]
    out = [[int(f.argmax())] for f in first]
    live = list(range(len(ROWS)))
    while live := [r for r in live if len(out[r]) < ROWS[r][2]]:  # a row leaves at its length
        logits = engine.step([seqs[r] for r in live], [out[r][-1] for r in live])
        for r, row in zip(live, logits):
            out[r].append(int(row.argmax()))
    wants = []
    for r, ((adapter, _, n), i) in enumerate(zip(ROWS, ids)):
        want, want_logits = peft_greedy(model, i, n, adapter)
        assert out[r] == want, (r, adapter)
        assert (first[r] - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()
        wants.append(want)
    # the adapters do change the outputs (else the check above would not see a mix-up)
    assert len({tuple(wants[r][:8]) for r in (2, 3, 5)}) == 3


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Olmo3ForCausalLM", "GraniteForCausalLM",
                                  "Phi3ForCausalLM", "Qwen3MoeForCausalLM", "Lfm2ForCausalLM",
                                  "Lfm2MoeForCausalLM"])  # fmt: skip
def test_decode_weights_are_the_dequantized_model(arch, fmt, tok):
    """The engine with ``fmt`` weights = transformers' fp32 forward with every Linear (the head
    included, the embedding not: as the engine packs them) and every fused expert tensor (the
    MoE router not: fp32 in the engine) replaced by its dequantized weight."""
    model = build_arch_model(arch, tok)
    engine = decode.DecodeEngine(model, fmt)
    ref = copy.deepcopy(model)
    for module in list(ref.modules()):
        if isinstance(module, nn.Linear):  # a new Parameter: a tied head no longer is
            packed = quant_linear.pack(module.weight.detach(), fmt)
            module.weight = nn.Parameter(quant_linear.dequantize(packed))
        for name in ("gate_up_proj", "down_proj"):  # experts (E, N, K), packed as (E·N, K) rows
            w = getattr(module, name, None)
            if isinstance(w, nn.Parameter) and w.dim() == 3:
                packed = quant_linear.pack(w.detach().reshape(-1, w.shape[2]), fmt)
                setattr(module, name, nn.Parameter(quant_linear.dequantize(packed).view(w.shape)))
    ids = tok(PROMPTS[3])["input_ids"]
    got = engine.prefill(engine.open(None, len(ids)), ids, all_logits=True)
    with torch.no_grad():
        want, plain = (m(torch.tensor([ids])).logits[0] for m in (ref, model))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (plain - want).abs().max() > 1e-3 * want.abs().max()  # the format does change them


def test_rope_that_changes_with_length_is_refused_with_its_reason(tok):
    model = build_arch_model("Phi3ForCausalLM", tok)
    model.model.rotary_emb.rope_type = "longrope"  # Phi-3-128k's rope: short/long factors
    assert families.read(model) == "rope_type 'longrope' changes with the sequence length"
    model = build_arch_model("Gemma3ForCausalLM", tok)
    model.config.use_bidirectional_attention = True  # EmbeddingGemma
    assert "bidirectional" in families.read(model)


def test_lora_on_moe_experts_is_refused_with_its_reason(tok):
    """PEFT's target_parameters adapters on the fused experts: the engine does not apply them,
    so it refuses the model (the model's forward generates) and says why."""
    from peft import LoraConfig, get_peft_model

    model = build_arch_model("Qwen3MoeForCausalLM", tok)
    config = LoraConfig(r=4, target_modules=ATTN, init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    peft = get_peft_model(model, config)
    assert decode.engine_for(peft) is None
    reason = decode.unavailable_reason(peft)
    assert "layer 0's experts carry LoRA adapters" in reason, reason
