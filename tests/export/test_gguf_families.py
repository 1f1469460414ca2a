"""Every GGUF family, checked by llama.cpp itself (cyllama): a tiny random model from each
architecture's transformers config, exported at f32, loads in llama.cpp and its greedy tokens
equal transformers fp32 on the same weights, base and with a non-zero LoRA adapter merged.

The configs (``lorafuse.testing.arch_families``) make the family's special parts matter: Llama 3
rope scaling with a small ``original_max_position_embeddings``, q/k/v bias (Qwen2), q/k norms and
head_dim != hidden/heads (Qwen3, Gemma), soft-capping and sliding windows of 16 tokens (Gemma 2/3)
under a prompt of ~120 tokens, Gemma 3's per-layer-type rope theta, Phi's fused qkv / gate_up,
SmolLM3's no-rope layers. All carry SmolLM2's tokenizer (llama.cpp does not tie the vocab to the
architecture).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_gguf_llamacpp import (  # same directory: on sys.path (rootdir import mode)
    LlamaCpp,
    _hf_greedy,
)

from lorafuse.export.gguf_export import write_gguf
from lorafuse.export.gguf_families import FAMILIES, llama3_rope_factors
from lorafuse.export.gguf_vocab import GGUFExportError
from lorafuse.export.merge import merge_adapter
from lorafuse.testing import save_tiny_adapter
from lorafuse.testing.arch_families import ARCH_CASES as CASES
from lorafuse.testing.arch_families import SMALL, save_arch_model
from lorafuse.testing.new_families import FAMILY_CASES

N_NEW = 6
# the ids of PROMPTS-like text, and one ~120 tokens long: past the 16-token sliding windows and
# the llama3 original context of 32
TEXTS = ["What is the capital of France?", "  LoRA adapters:\tmerged  into\nthe base (2024-07-04)",
         " ".join(f"item {i}: the quick brown fox;" for i in range(17))]  # fmt: skip


def test_every_architecture_has_a_case():
    """Each GGUF family is checked here or, for the late-2026 ones, in test_gguf_families_2026."""
    assert set(CASES) | set(FAMILY_CASES) == set(FAMILIES)
    assert not set(CASES) & set(FAMILY_CASES)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_family_f32_greedy_equals_transformers_base_and_merged(arch, smol_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    tok = smol_tokenizer
    save_arch_model(arch, tmp_path / "base", tok)
    save_tiny_adapter(tmp_path / "base", tmp_path / "adapter", target_modules=CASES[arch][2])
    merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    greedy = {}
    for name in ("base", "merged"):
        # pre named: under a qwen2 config AutoTokenizer rebuilds SmolLM2's tokenizer as Qwen2's
        # (its own split regex), so the converter's hash no longer identifies it
        llm = LlamaCpp(write_gguf(tmp_path / name, tmp_path / f"{name}.gguf", "f32", pre="smollm"))
        assert llm.model.meta_val_str("general.architecture") == FAMILIES[arch].name
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        for text in TEXTS:
            ids = tok(text)["input_ids"]
            got, _ = llm.greedy(ids, N_NEW)
            want, _ = _hf_greedy(model, ids, N_NEW)
            assert got == want, f"{arch} {name}: {len(ids)}-token prompt {text[:30]!r}"
            greedy[name, text] = got
    # the adapter must change what is generated, or "merged" would prove nothing
    assert any(greedy["base", t] != greedy["merged", t] for t in TEXTS)


def test_llama3_rope_freqs_scale_only_the_long_wavelengths():
    cfg = {**SMALL, **CASES["LlamaForCausalLM"][1], "architectures": ["LlamaForCausalLM"]}
    f = llama3_rope_factors(cfg)  # (head_dim / 2,): 1 for short wavelengths, factor 8 for long
    assert f.shape == (8,) and f[0] == 1.0 and f[-1] == 8.0
    assert ((f >= 1.0) & (f <= 8.0)).all() and (f[1:] >= f[:-1]).all()


def test_unsupported_architecture_and_layouts_are_refused(tmp_path):
    from lorafuse.export.gguf_export import check_exportable

    with pytest.raises(GGUFExportError, match="supported: .*Gemma3ForCausalLM.*Qwen3ForCausalLM"):
        check_exportable({"architectures": ["GPTNeoXForCausalLM"]}, "f16")
    with pytest.raises(GGUFExportError, match="q4_k_m"):
        check_exportable({"architectures": ["LlamaForCausalLM"]}, "q9_z")
    gemma = {**SMALL, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2, "head_dim": 32,
             "query_pre_attn_scalar": 32, "layer_types": ["full_attention", "sliding_attention"]}  # fmt: skip
    with pytest.raises(GGUFExportError, match="layer_types"):
        check_exportable(gemma, "f16")
    phi = {**SMALL, "architectures": ["Phi3ForCausalLM"], "num_hidden_layers": 2,
           "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}}  # fmt: skip
    with pytest.raises(GGUFExportError, match="longrope"):
        check_exportable(phi, "f16")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(GGUFExportError, match="BertModel"):
        write_gguf(tmp_path, tmp_path / "x.gguf", "f32")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.slow
def test_gemma3_27b_layer_count_scales_queries_by_hidden_over_heads(
    smol_tokenizer, tmp_path, close
):
    """Gemma 3 27B's query_pre_attn_scalar (hidden / heads = 168, not head_dim 128): llama.cpp
    applies it to a 62-layer gemma3, so a tiny 62-layer model with scalar hidden / heads = 16
    (head_dim 32) exports and llama.cpp's greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from lorafuse.export.gguf_export import check_exportable

    base = {**SMALL, "architectures": ["Gemma3ForCausalLM"], "head_dim": 32, "sliding_window": 16}

    with pytest.raises(GGUFExportError, match=r"head_dim = 32 for a 7-layer"):
        check_exportable({**base, "num_hidden_layers": 7, "query_pre_attn_scalar": 16}, "f32")
    with pytest.raises(GGUFExportError, match=r"hidden_size / heads .* = 16 for a 62-layer"):
        check_exportable({**base, "num_hidden_layers": 62, "query_pre_attn_scalar": 32}, "f32")
    big = dict(num_hidden_layers=62, head_dim=32, query_pre_attn_scalar=16, sliding_window=16)
    save_arch_model("Gemma3ForCausalLM", tmp_path / "base", smol_tokenizer, big)
    assert Gemma3TextConfig.from_pretrained(tmp_path / "base").query_pre_attn_scalar == 16
    llm = LlamaCpp(write_gguf(tmp_path / "base", tmp_path / "g.gguf", "f32", pre="smollm"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    for text in TEXTS[:2]:
        ids = smol_tokenizer(text)["input_ids"]
        (got, got_logits), (want, want_logits) = llm.greedy(ids, 3), _hf_greedy(model, ids, 3)
        assert got == want, text[:30]
        # fp32 op-order noise over 62 layers (measured max 1.0e-3, mean 2e-4; 2 layers: 5e-5);
        # queries scaled by 1/sqrt(head_dim) instead move them by up to 0.44 (mean 0.08)
        close(torch.from_numpy(got_logits), want_logits, atol=5e-3, rtol=1e-5, name=text[:30])


def test_a_phi3_name_on_a_vocab_without_phi3_s_tokens_is_respelled_so_llama_cpp_loads(
    smol_tokenizer, tmp_path
):
    """llama.cpp gives a model whose general.name contains "phi3" Phi-3's token attributes and
    aborts loading ("unordered_map::at") when the vocab lacks ``</s>``: a fine-tune of Phi-4 (or
    any vocab without it) saved as ``phi3-...`` would export a file llama.cpp refuses."""
    from lorafuse.export.gguf_vocab import GGUFVocab, loadable_name

    save_arch_model("Phi3ForCausalLM", tmp_path / "phi3-mini-ft", smol_tokenizer)
    with pytest.warns(UserWarning, match="'phi3-mini-ft' written as 'phi 3-mini-ft'"):
        path = write_gguf(tmp_path / "phi3-mini-ft", tmp_path / "p.gguf", "f32", pre="smollm")
    llm = LlamaCpp(path)  # fails to load under the name phi3-mini-ft
    assert llm.model.meta_val_str("general.name") == "phi 3-mini-ft"
    phi3_vocab = GGUFVocab(
        "llama", "default", ["<unk>", "<s>", "</s>", "<|endoftext|>", "a"], [1] * 5
    )
    assert loadable_name("Phi-3-mini-ft", phi3_vocab) == "Phi-3-mini-ft"  # Phi-3's own vocab
    assert loadable_name("llama-ft", phi3_vocab) == "llama-ft"
