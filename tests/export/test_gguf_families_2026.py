"""The late-2026 families (``testing.new_families``: Qwen3.5, Qwen3-Next, Qwen3.5-MoE, LFM2,
LFM2-MoE, Granite 4 hybrid, Gemma 4 text, OLMo 3, Qwen3-MoE, gpt-oss) merged and exported, each
checked by the tool that reads it: transformers reloads the merged dir with stock PEFT's own
merge; llama.cpp (llama-cpp-python 0.3.36) runs ``lorafuse export --format gguf`` of base +
adapter (f32) with transformers' greedy tokens and logits, the base GGUF plus the adapter GGUF
with the unmerged PEFT model's, and llama.cpp's quantizer makes a q4_k_m of each whose logits
point the way f32's do. Prompts of ~160 tokens run past the 16-token sliding windows, the conv kernels (3-4) and the
Mamba2 chunks (8). The adapters are ordinary LoRA (no routed experts: folding expert LoRA is
``merge``'s; an expert-LoRA adapter GGUF is refused, see the last test).

Gemma 4's oracle reads GELU through fp16, as ggml's CPU GELU does (a table of fp16 values):
exact GELU puts transformers 2e-3 from llama.cpp on the same weights, fp16 GELU 8e-6; where the
inputs differ by rounding (the unmerged adapter's extra product) an element can still land one
fp16 step away (measured 1.1e-3), so Gemma 4's logits bound is ``GELU_ATOL``.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from test_gguf_lora import _hf_greedy, _llama_cpp_greedy  # same directory (rootdir import mode)
from test_gguf_quantize import TEXT

from lorafuse.export.gguf_export import quantize_gguf, write_gguf
from lorafuse.export.gguf_families import FAMILIES
from lorafuse.export.gguf_lora import write_lora_gguf
from lorafuse.export.merge import merge_adapter
from lorafuse.testing import save_tiny_adapter
from lorafuse.testing.new_families import FAMILY_CASES, save_family_model

NEW = sorted(FAMILY_CASES)
# what the tiny configs change for llama.cpp to run them as transformers does (the refusals
# below check that the defaults are refused or warned about)
RUNNABLE = {
    "Qwen3MoeForCausalLM": {"norm_topk_prob": True},  # llama.cpp renormalises the top-k weights
    "GptOssForCausalLM": {"rope_parameters": {  # llama.cpp truncates YaRN's correction range
        "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}},
}  # fmt: skip
# ordinary LoRA: the family's Linears but the MLPs of Qwen3-Next / Qwen3.5-MoE, whose
# gate/up/down_proj names (the shared expert's too) PEFT 0.21 turns into target_parameters on the
# fused routed experts
_NO_MLP = [t for t in FAMILY_CASES["Qwen3_5MoeForCausalLM"][3] if not t.endswith(("gate_proj", "up_proj", "down_proj"))]  # fmt: skip
TARGETS = {**{a: case[3] for a, case in FAMILY_CASES.items()}, "Qwen3_5MoeForCausalLM": _NO_MLP,
           "Qwen3NextForCausalLM": FAMILY_CASES["Qwen3NextForCausalLM"][3][:4] + ["in_proj_qkvz", "in_proj_ba", "out_proj"]}  # fmt: skip
LONG = " ".join(f"item {i}: the quick brown fox;" for i in range(17))  # ~160 tokens
N_NEW = 4
ATOL, GELU_ATOL = 1e-3, 3e-3


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, smol_tokenizer):
    """``make(arch)``: ``base/`` (tiny model, SmolLM2's tokenizer), ``adapter/`` (ordinary LoRA,
    non-zero B), ``merged/``; built once per family for every test of this module."""
    built = {}

    def make(arch):
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            save_family_model(arch, root / "base", smol_tokenizer, **RUNNABLE.get(arch, {}))
            save_tiny_adapter(root / "base", root / "adapter", target_modules=TARGETS[arch])
            merge_adapter(root / "base", root / "adapter", root / "merged")
            built[arch] = root
        return built[arch]

    return make


def _transformers(path, arch, ggml: bool = True, dtype=torch.float32):
    """The model at ``path``; ``ggml``: its GELU as llama.cpp computes it (Gemma 4)."""
    from transformers import AutoModelForCausalLM

    # transformers' grouped expert product has no fp64 kernel; its loop over experts does
    kw = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
    if ggml and arch == "Gemma4ForCausalLM":  # ggml's CPU GELU: fp16 in, fp16 out
        for module in model.modules():
            if type(module).__name__ == "GELUTanh":
                exact = module.forward
                module.forward = lambda x, f=exact: f(x.half().float()).half().float()
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_every_new_family_has_a_gguf_layout():
    assert set(FAMILY_CASES) <= set(FAMILIES)


@pytest.mark.parametrize("arch", NEW)
def test_new_family_merges_to_peft_s_own_merge(arch, family_dirs, close):
    """The merged dir, reloaded by transformers, equals stock PEFT's ``merge_and_unload`` of the
    same adapter: every weight (1e-6) and the logits. Weights, not logits against the unmerged
    model, carry the check: these tiny hybrids amplify fp32 rounding (at 17 tokens the unmerged
    Qwen3-Next's fp32 logits are 2e-4 from its fp64 ones), where a missed tensor, scale or
    layout moves a weight by O(1)."""
    from peft import PeftModel

    root = family_dirs(arch)
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    peft = PeftModel.from_pretrained(
        _transformers(root / "base", arch, ggml=False), root / "adapter"
    )
    with torch.no_grad(), peft.disable_adapter():
        plain = peft(ids).logits
    oracle = peft.merge_and_unload().eval()
    merged = _transformers(root / "merged", arch, ggml=False)
    want = dict(oracle.named_parameters())
    assert set(dict(merged.named_parameters())) == set(want)
    for name, p in merged.named_parameters():
        close(p, want[name], atol=1e-6, rtol=1e-6, name=name)
    with torch.no_grad():
        got, expected = merged(ids).logits, oracle(ids).logits
    assert (expected - plain).abs().max() > 0.1  # the adapter matters
    close(got, expected, atol=1e-5, rtol=1e-5, name=f"{arch} logits")


@pytest.mark.parametrize("arch", NEW)
def test_new_family_f32_gguf_greedy_in_llama_cpp_equals_transformers(arch, family_dirs,
                                                                     smol_tokenizer, close):  # fmt: skip
    from lorafuse.commands import main

    root = family_dirs(arch)
    path = root / "merged.gguf"  # the command merges base + adapter (fp32), then writes the GGUF
    assert main(["export", "--model", str(root / "base"), "--adapter", str(root / "adapter"),
                 "--format", "gguf", "--outtype", "f32", "--pre-tokenizer", "smollm",
                 "-o", str(path)]) == 0  # fmt: skip
    model = _transformers(root / "merged", arch)
    ids = smol_tokenizer(LONG)["input_ids"]
    (got, got_logits), (want, want_logits) = _llama_cpp_greedy(path, ids, N_NEW), _hf_greedy(model, ids, N_NEW)  # fmt: skip
    assert got == want, arch
    # fp32 in another op order: measured at most 1.1e-5 on logits of ~6 (Qwen3-Next); a wrong
    # head order, norm offset or rope moves them by 1e-2 to O(1)
    close(torch.from_numpy(got_logits), want_logits, atol=_atol(arch), rtol=1e-5, name=arch)


def _atol(arch: str) -> float:
    return GELU_ATOL if arch == "Gemma4ForCausalLM" else ATOL


@pytest.mark.parametrize("arch", NEW)
def test_new_family_adapter_gguf_in_llama_cpp_equals_peft_unmerged(arch, family_dirs,
                                                                   smol_tokenizer, close):  # fmt: skip
    from peft import PeftModel

    root = family_dirs(arch)
    base_gguf = write_gguf(root / "base", root / "base.gguf", "f32", pre="smollm")
    lora_gguf = write_lora_gguf(root / "base", root / "adapter", root / "lora.gguf")
    peft = PeftModel.from_pretrained(_transformers(root / "base", arch), root / "adapter").eval()
    ids = smol_tokenizer(LONG)["input_ids"]
    got, got_logits = _llama_cpp_greedy(base_gguf, ids, 4, lora=lora_gguf)
    want, want_logits = _hf_greedy(peft, ids, 4)
    assert got == want, (
        f"{arch}: {got} != {want}, logits {np.abs(got_logits - want_logits.numpy()).max():.2e}"
    )
    # as the merged export; a delta that missed a value-head reorder or a split moves them by O(1)
    close(torch.from_numpy(got_logits), want_logits, atol=_atol(arch), rtol=1e-5, name=arch)
    _, plain = _llama_cpp_greedy(base_gguf, ids, 1)
    assert np.abs(plain - got_logits).max() > 0.1  # llama.cpp applied the adapter


# each family at widths that are multiples of 256 (no K-quant fallback): hidden 256 and every
# projection's input (MLP, experts, heads, value heads) 256 or 512. Gemma 4 without per-layer
# inputs here (their embedding is vocab x layers x width: 200 MB at 256; the f32 test has them)
_W = dict(hidden_size=256, intermediate_size=512)
_GDN = dict(_W, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)
_MOE = dict(moe_intermediate_size=256, shared_expert_intermediate_size=256)
WIDE = {
    "Qwen3_5ForCausalLM": _GDN, "Qwen3NextForCausalLM": {**_GDN, **_MOE},
    "Qwen3_5MoeForCausalLM": {**_GDN, **_MOE}, "Lfm2ForCausalLM": _W,
    "Lfm2MoeForCausalLM": dict(_W, moe_intermediate_size=256), "Olmo3ForCausalLM": _W,
    "GraniteMoeHybridForCausalLM": dict(_W, shared_intermediate_size=256, mamba_d_head=64),
    "Gemma4ForCausalLM": dict(_W, head_dim=64, hidden_size_per_layer_input=0),
    "Qwen3MoeForCausalLM": dict(_W, head_dim=64, moe_intermediate_size=256),
    "GptOssForCausalLM": dict(hidden_size=256, intermediate_size=256, head_dim=64),
}  # fmt: skip


# The tiny random Gated-DeltaNet + MoE models carry quantization noise further than 0.8 allows:
# mean cosine to f32 at q8_0 / q6_k / q4_k_m: Qwen3-Next 0.994 / 0.943 / 0.650, Qwen3.5-MoE
# 0.995 / 0.950 / 0.716, the logit error growing ~3-4x per 2 bits as weight noise does (a misplaced
# tensor would show at q8_0 too; the f32 test guards the layout). Strict: a pass reports itself.
_Q4_NOISY = {"Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"}
Q4_CASES = [pytest.param(a, marks=pytest.mark.xfail(strict=True, reason="q4_k_m noise on the tiny GDN+MoE model; see _Q4_NOISY")) if a in _Q4_NOISY else a for a in NEW]  # fmt: skip


@pytest.mark.parametrize("arch", Q4_CASES)
def test_new_family_quantizes_to_q4_k_m_close_to_its_f32(arch, smol_tokenizer, tmp_path):
    """llama.cpp's quantizer on each family: the q4_k_m file type, size < f32 / 4, teacher-forced
    logits over 48 tokens pointing the way f32's do (mean cosine, as the older families' test)."""
    import gguf

    save_family_model(arch, tmp_path / "model", smol_tokenizer, **WIDE[arch], **RUNNABLE.get(arch, {}))  # fmt: skip
    f32 = write_gguf(tmp_path / "model", tmp_path / "f32.gguf", "f32", pre="smollm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # widths are multiples of 256: no fallback to report
        q = quantize_gguf(f32, tmp_path / "q.gguf", "q4_k_m")  # what --outtype q4_k_m runs
    assert q.stat().st_size < f32.stat().st_size / 4
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(q).tensors}
    assert gguf.GGMLQuantizationType.Q4_K in types.values()
    ids = smol_tokenizer(TEXT)["input_ids"][:48]
    a, b = _teacher_forced(f32, ids), _teacher_forced(q, ids)
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cosine.mean() > 0.8, f"{arch}: mean cosine {cosine.mean():.3f}"


def _teacher_forced(path, ids) -> np.ndarray:
    """(len(ids), vocab) centred logits of one llama.cpp pass over ``ids``."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=128, n_batch=128, n_threads=2, verbose=False,
                          type_k=0, type_v=0, flash_attn=False, logits_all=True)  # fmt: skip
    try:
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    finally:
        llm.close()
    return logits - logits.mean(axis=1, keepdims=True)


def _config(arch: str, **overrides) -> dict:
    from lorafuse.testing.new_families import family_config

    return family_config(arch, **overrides).to_dict()


@pytest.mark.parametrize(
    "arch, overrides, message",
    [("Qwen3MoeForCausalLM", {}, "norm_topk_prob false"),
     ("Qwen3NextForCausalLM", {"mlp_only_layers": [1]}, "mlp_only_layers"),
     ("Qwen3_5ForCausalLM", {"attention_bias": True}, "attention_bias"),
     ("Lfm2MoeForCausalLM", {"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
     ("GraniteMoeHybridForCausalLM", {"time_step_limit": (0.0, 10.0)}, "time_step_limit"),
     ("GraniteMoeHybridForCausalLM", {"mamba_expand": 3, "mamba_n_heads": 12}, "mamba_expand 3"),
     ("GraniteMoeHybridForCausalLM", {"num_local_experts": 0}, "without experts"),
     ("Gemma4ForCausalLM", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                            "moe_intermediate_size": 32}, "MoE block"),
     ("Olmo3ForCausalLM", {"rope_parameters": {
         "full_attention": {"rope_type": "default", "rope_theta": 1e4},
         "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}}, "'linear'"),
     ("GptOssForCausalLM", {"swiglu_limit": 5.0}, "limit 5.0")],
)  # fmt: skip
def test_what_llama_cpp_runs_differently_is_refused_naming_it(arch, overrides, message):
    from lorafuse.export.gguf_export import check_exportable
    from lorafuse.export.gguf_vocab import GGUFExportError

    with pytest.raises(GGUFExportError, match=message):
        check_exportable(_config(arch, **overrides), "f32")


def test_what_llama_cpp_runs_slightly_differently_is_warned():
    from lorafuse.export.gguf_export import check_exportable

    # gpt-oss's own YaRN (truncate=false): llama.cpp truncates every gpt-oss GGUF's
    with pytest.warns(UserWarning, match="truncate=true"):
        check_exportable(_config("GptOssForCausalLM"), "f32")
    # a hybrid pattern older llama.cpp builds place differently
    types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    with pytest.warns(UserWarning, match="attention.recurrent_layers"):
        check_exportable(_config("Qwen3_5ForCausalLM", layer_types=types), "f32")


def test_expert_lora_adapter_gguf_is_refused_with_the_reason(family_dirs, tmp_path):
    from lorafuse.export.gguf_vocab import GGUFExportError

    root = family_dirs("Qwen3NextForCausalLM")
    adapter = tmp_path / "experts"
    save_tiny_adapter(
        root / "base", adapter, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert json.loads((adapter / "adapter_config.json").read_text())["target_parameters"]
    with pytest.raises(GGUFExportError, match="can apply LoRA to its stacked expert tensors"):
        write_lora_gguf(root / "base", adapter, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
