"""``lorafuse export --format gguf-lora``: the adapter alone, as llama.cpp's ``--lora`` loads it.

The file layout is read back with gguf-py and checked against the merged export (base GGUF +
alpha/r * B @ A = merged GGUF, q/k permutation included); what llama.cpp cannot express is
refused before anything is written; and llama.cpp itself (llama-cpp-python, the binding that can
apply an adapter to a context) runs base GGUF + adapter GGUF and must give transformers' fp32
greedy tokens and logits on the unmerged PEFT model, at scale 1 and at a user scale.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from lorafuse.commands import main
from lorafuse.export.gguf_export import write_gguf
from lorafuse.export.gguf_families import FAMILIES
from lorafuse.export.gguf_lora import write_lora_gguf
from lorafuse.export.gguf_vocab import GGUFExportError
from lorafuse.testing import save_tiny_adapter, save_tiny_model
from lorafuse.testing.arch_families import ARCH_CASES, save_arch_model


def _tensors(path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(path)
    return {t.name: np.asarray(t.data, dtype=np.float32).reshape(t.data.shape) for t in r.tensors}


def _field(path, key):
    f = gguf.GGUFReader(path).fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else float(value[0])


def test_adapter_gguf_is_the_merged_delta_with_the_q_k_permutation(smol_tiny, tmp_path):
    out = tmp_path / "adapter.gguf"
    assert main(["export", "--model", str(smol_tiny / "base"), "--adapter", str(smol_tiny / "adapter"),
                 "--format", "gguf-lora", "--outtype", "f32", "-o", str(out)]) == 0  # fmt: skip
    assert _field(out, "general.type") == "adapter"
    assert _field(out, "general.architecture") == "llama"
    assert _field(out, "adapter.type") == "lora"
    cfg = json.loads((smol_tiny / "adapter" / "adapter_config.json").read_text())
    alpha = _field(out, "adapter.lora.alpha")
    assert alpha == cfg["lora_alpha"]
    lora = _tensors(out)
    base = _tensors(write_gguf(smol_tiny / "base", tmp_path / "base.gguf", "f32"))
    merged = _tensors(write_gguf(smol_tiny / "merged", tmp_path / "merged.gguf", "f32"))
    n_layers = json.loads((smol_tiny / "base" / "config.json").read_text())["num_hidden_layers"]
    assert len(lora) == 2 * 7 * n_layers  # q k v o gate up down, every layer
    for name in base:
        if f"{name}.lora_a" not in lora:
            assert np.array_equal(base[name], merged[name]), name  # not adapted
            continue
        a, b = lora[f"{name}.lora_a"], lora[f"{name}.lora_b"]  # (r, in), (out, r)
        assert a.shape[0] == b.shape[1] == cfg["r"]
        delta = alpha / a.shape[0] * (b @ a)
        # a wrong q/k permutation of lora_b moves rows by O(|delta|), far above fp32 rounding
        np.testing.assert_allclose(
            base[name] + delta, merged[name], atol=1e-5, rtol=1e-5, err_msg=name
        )


def _adapter(tmp_path, base, **lora_kwargs):
    """A PEFT adapter on ``base`` with LoraConfig options (random non-zero B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                        "init_lora_weights": False, **lora_kwargs})  # fmt: skip
    out = tmp_path / "adapter"
    get_peft_model(model, cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_base") / "base"
    save_tiny_model(path)
    return path


@pytest.mark.parametrize(
    "kwargs, message",
    [({"use_dora": True}, "DoRA"),
     ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
     ({"alpha_pattern": {"v_proj": 32}}, "per-module LoRA scaling"),
     ({"use_rslora": True, "rank_pattern": {"v_proj": 8}}, "per-module LoRA scaling"),
     ({"target_modules": ["embed_tokens"]}, "embedding LoRA"),
     ({"bias": "lora_only"}, "bias='lora_only'")],
)  # fmt: skip
def test_what_llama_cpp_cannot_express_is_refused_before_writing(tiny_base, tmp_path, capsys,
                                                                 kwargs, message):  # fmt: skip
    adapter = _adapter(tmp_path, tiny_base, **kwargs)
    out = tmp_path / "out" / "a.gguf"
    with pytest.raises(GGUFExportError, match=message):
        write_lora_gguf(tiny_base, adapter, out)
    assert main(["export", "--model", str(tiny_base), "--adapter", str(adapter),
                 "--format", "gguf-lora", "-o", str(out)]) == 2  # fmt: skip
    assert message in capsys.readouterr().err and not out.exists()


def test_rank_pattern_and_rslora_fold_into_the_one_alpha(tiny_base, tmp_path):
    # rank_pattern alone: llama.cpp reads r per tensor, so alpha / r_m is PEFT's scaling
    out = write_lora_gguf(tiny_base, _adapter(tmp_path / "rp", tiny_base, rank_pattern={"v_proj": 8}),
                          tmp_path / "rp.gguf")  # fmt: skip
    assert _field(out, "adapter.lora.alpha") == 8.0
    assert _tensors(out)["blk.0.attn_v.weight.lora_b"].shape[1] == 8
    # rsLoRA at one rank: alpha / sqrt(r) = alpha' / r with alpha' = alpha * sqrt(r)
    out = write_lora_gguf(tiny_base, _adapter(tmp_path / "rs", tiny_base, use_rslora=True),
                          tmp_path / "rs.gguf")  # fmt: skip
    assert _field(out, "adapter.lora.alpha") == pytest.approx(8.0 * 2.0)


def test_existing_output_wrong_suffix_no_adapter_and_tied_lm_head(tiny_base, tmp_path, capsys):
    adapter = _adapter(tmp_path, tiny_base)
    out = tmp_path / "a.gguf"
    out.write_text("keep")
    with pytest.raises(GGUFExportError, match="exists"):
        write_lora_gguf(tiny_base, adapter, out)
    assert out.read_text() == "keep"
    write_lora_gguf(tiny_base, adapter, out, overwrite=True)
    assert _field(out, "general.type") == "adapter"
    with pytest.raises(GGUFExportError, match=r"\.gguf"):
        write_lora_gguf(tiny_base, adapter, tmp_path / "a.bin")
    assert main(["export", "--model", str(tiny_base), "--format", "gguf-lora", "-o", str(out)]) == 2
    assert "needs --adapter" in capsys.readouterr().err
    config = json.loads((tiny_base / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        with pytest.raises(GGUFExportError, match="tied-embedding"):
            write_lora_gguf(tiny_base, _adapter(tmp_path / "lm", tiny_base, target_modules=["lm_head"]),
                            tmp_path / "lm.gguf")  # fmt: skip


def test_q8_0_keeps_rank_rows_in_f16(tiny_base, tmp_path):
    with pytest.warns(UserWarning, match="not a multiple of 32"):
        out = write_lora_gguf(tiny_base, _adapter(tmp_path, tiny_base), tmp_path / "q.gguf", "q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight.lora_a"] == gguf.GGMLQuantizationType.Q8_0  # row = hidden 64
    assert types["blk.0.attn_q.weight.lora_b"] == gguf.GGMLQuantizationType.F16  # row = r 4


# ---- llama.cpp itself applies the adapter ------------------------------------------------------

PROMPTS = ["What is the capital of France?",
           "<|im_start|>user\nAdd 12 and 345, then 6789.<|im_end|>\n<|im_start|>assistant\n"]  # fmt: skip
N_NEW = 8


def _llama_cpp_greedy(base_gguf, ids, n, lora=None, scale=1.0):
    llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python (dev extra)")
    kwargs = {"lora_path": str(lora), "lora_scale": scale} if lora else {}
    # f32 KV cache, no flash attention: the fp32 computation transformers does
    llm = llama_cpp.Llama(str(base_gguf), n_ctx=256, n_batch=256, n_threads=2, verbose=False,
                          type_k=0, type_v=0, flash_attn=False, logits_all=True, **kwargs)  # fmt: skip
    out, first = [], None
    llm.eval(ids)
    for _ in range(n):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        first = logits.copy() if first is None else first
        out.append(int(logits.argmax()))
        llm.eval([out[-1]])
    llm.close()
    return out, first


def _hf_greedy(model, ids, n):
    x, out, first = torch.tensor([ids]), [], None
    with torch.no_grad():
        for _ in range(n):
            logits = model(x).logits[0, -1]
            first = logits if first is None else first
            out.append(int(logits.argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]])], dim=1)
    return out, first


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_llama_cpp_with_the_adapter_equals_transformers_peft_unmerged(smol_tiny, tmp_path, close,
                                                                      scale):  # fmt: skip
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_gguf = write_gguf(smol_tiny / "base", tmp_path / "base.gguf", "f32")
    lora_gguf = write_lora_gguf(smol_tiny / "base", smol_tiny / "adapter", tmp_path / "lora.gguf")
    base = AutoModelForCausalLM.from_pretrained(smol_tiny / "base", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, smol_tiny / "adapter").eval()  # unmerged LoRA layers
    for module in peft.modules():  # llama.cpp's user scale multiplies every alpha / r
        if isinstance(getattr(module, "scaling", None), dict):
            module.scaling = {k: v * scale for k, v in module.scaling.items()}
    tok = AutoTokenizer.from_pretrained(smol_tiny / "base")
    changed = False
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        got, got_logits = _llama_cpp_greedy(base_gguf, ids, N_NEW, lora=lora_gguf, scale=scale)
        want, want_logits = _hf_greedy(peft, ids, N_NEW)
        assert got == want, prompt
        # same fp32 math in another op order (the merged-export test measured 5e-5 on logits
        # of ~14); a wrong lora_b permutation or scale moves them by O(1)
        close(torch.from_numpy(got_logits), want_logits, atol=1e-3, rtol=1e-5, name=prompt)
        plain, plain_logits = _llama_cpp_greedy(base_gguf, ids, N_NEW)
        changed |= plain != got
        assert np.abs(plain_logits - got_logits).max() > 0.1  # the adapter was applied
    assert changed  # and it changes generations, so the equality above can fail


@pytest.mark.parametrize("arch", sorted(ARCH_CASES))
def test_every_family_s_adapter_in_llama_cpp_equals_transformers_peft_unmerged(
    arch, smol_tokenizer, tmp_path, close
):
    """Each architecture's own tiny model (``testing.arch_families``: Llama 3 rope scaling, q/k/v
    bias, q/k norms, head_dim != hidden / heads, soft-capping, sliding windows, Phi's fused qkv /
    gate_up, SmolLM3's no-rope layers): base GGUF + adapter GGUF in llama.cpp give the unmerged
    PEFT model's greedy tokens and logits on a ~120-token prompt (past the 16-token windows and
    the llama3 original context of 32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    save_arch_model(arch, tmp_path / "base", smol_tokenizer)
    save_tiny_adapter(tmp_path / "base", tmp_path / "adapter", target_modules=ARCH_CASES[arch][2])
    base_gguf = write_gguf(tmp_path / "base", tmp_path / "base.gguf", "f32", pre="smollm")
    lora_gguf = write_lora_gguf(tmp_path / "base", tmp_path / "adapter", tmp_path / "lora.gguf")
    assert _field(lora_gguf, "general.architecture") == FAMILIES[arch].name
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = smol_tokenizer(" ".join(f"item {i}: the quick brown fox;" for i in range(17)))[
        "input_ids"
    ]
    got, got_logits = _llama_cpp_greedy(base_gguf, ids, 4, lora=lora_gguf)
    want, want_logits = _hf_greedy(peft, ids, 4)
    assert got == want, arch
    # fp32 in another op order (measured: 1.4e-4 with Gemma's soft-capping, 3e-6 at most for the
    # rest, on logits up to 2.7); a wrong permutation of lora_b, a
    # missed tensor or a wrong alpha moves logits by O(1)
    close(torch.from_numpy(got_logits), want_logits, atol=1e-3, rtol=1e-5, name=arch)
    _, plain_logits = _llama_cpp_greedy(base_gguf, ids, 1)
    assert np.abs(plain_logits - got_logits).max() > 0.1  # the adapter was applied
