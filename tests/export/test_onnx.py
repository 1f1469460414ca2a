"""ONNX Runtime GenAI exports, checked by ONNX Runtime GenAI itself (its ``Generator``): each
family's fp32 folder gives transformers' fp32 greedy tokens on the merged model; a LoRA-input base
with two adapter files (different ranks and targets) gives each adapter's merged tokens and the
base's, switched back and forth on one loaded model; int4 / int8 build the runtime's quantized
MatMuls; refusals and a full disk are one line. Tiny random models of each architecture
(``lorafuse.testing.arch_families``) carrying SmolLM2's tokenizer; ~6 new tokens per prompt.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_gguf_llamacpp import _hf_greedy  # same directory: on sys.path (rootdir import mode)

from lorafuse import files
from lorafuse.commands import main
from lorafuse.export import onnx as onnx_export
from lorafuse.export.merge import merge_adapter
from lorafuse.testing import one_error_line, small_tmpfs
from lorafuse.testing.arch_families import ARCH_CASES, save_arch_model

og = pytest.importorskip("onnxruntime_genai", reason="pip install 'lorafuse[export]'")
pytest.importorskip("onnx_ir", reason="pip install 'lorafuse[export]'")

N_NEW = 6
# a short prompt and one of ~160 tokens: past the 16-token sliding windows and llama3's 32
TEXTS = [
    "What is the capital of France?",
    " ".join(f"item {i}: the quick brown fox;" for i in range(17)),
]
# Phi-3 with max == original positions: the builder reads a difference as LongRoPE
OVERRIDES = {
    "Phi3ForCausalLM": {**ARCH_CASES["Phi3ForCausalLM"][1], "original_max_position_embeddings": 512}
}


def make_family(root, arch, tok, adapters=((1, 4, None),)):
    """``root/base`` of ``arch``, and per (seed, r, targets) ``adapter{i}`` + ``merged{i}``."""
    from lorafuse.testing import save_tiny_adapter

    save_arch_model(arch, root / "base", tok, OVERRIDES.get(arch))
    for i, (seed, r, targets) in enumerate(adapters):
        save_tiny_adapter(root / "base", root / f"adapter{i}", seed=seed, r=r,
                          target_modules=targets or ARCH_CASES[arch][2])  # fmt: skip
        merge_adapter(root / "base", root / f"adapter{i}", root / f"merged{i}")
    return root


def hf_tokens(model_dir, ids_list):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [_hf_greedy(model, ids, N_NEW)[0] for ids in ids_list]


def genai_tokens(model, ids, adapters=None, name=None):
    """N_NEW greedy tokens from ONNX Runtime GenAI (max_length past Gemma 2's 16-token window:
    its windowed KV cache needs room for a whole window)."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=256, do_sample=False)
    gen = og.Generator(model, params)
    if name is not None:
        gen.set_active_adapter(adapters, name)
    gen.append_tokens(np.array([ids], dtype=np.int32))
    for _ in range(N_NEW):
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)[len(ids) :]]


FAST = "LlamaForCausalLM"
FAMILIES = [
    a if a == FAST else pytest.param(a, marks=pytest.mark.slow) for a in onnx_export.FAMILIES
]


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_fp32_greedy_equals_transformers_on_the_merged_model(arch, smol_tokenizer, tmp_path):
    make_family(tmp_path, arch, smol_tokenizer)
    out = onnx_export.write_onnx(tmp_path / "merged0", tmp_path / "onnx", "fp32")
    assert {"genai_config.json", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(out))
    ids_list = [smol_tokenizer(t)["input_ids"] for t in TEXTS]
    model = og.Model(str(out))
    got = [genai_tokens(model, ids) for ids in ids_list]
    assert got == hf_tokens(tmp_path / "merged0", ids_list), arch
    # the runtime's own tokenizer (from the folder) encodes as transformers does
    assert list(og.Tokenizer(model).encode(TEXTS[1])) == ids_list[1]


@pytest.mark.parametrize("arch", [FAST, pytest.param("Phi3ForCausalLM", marks=pytest.mark.slow)])
def test_adapter_files_switch_per_request_and_equal_each_merged_model(
    arch, smol_tokenizer, tmp_path
):
    """Phi-3: the fused qkv / gate_up LoRA is split into the builder's q/k/v and gate/up inputs.
    adapter1 has another rank (8) and only the first two targets: the rest keep their zeros."""
    targets = ARCH_CASES[arch][2]
    make_family(tmp_path, arch, smol_tokenizer, adapters=[(1, 4, None), (2, 8, targets[:2])])
    base = tmp_path / "onnx"
    argv = ["export", "--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter0"),
            "--format", "onnx", "--lora-inputs", "-o", str(base)]  # fmt: skip
    assert main(argv) == 0
    for i in range(2):
        argv = ["export", "--model", str(tmp_path / "base"), "--adapter", str(tmp_path / f"adapter{i}"),
                "--format", "onnx-adapter", "--base-onnx", str(base), "-o", str(tmp_path / f"a{i}.onnx_adapter")]  # fmt: skip
        assert main(argv) == 0
    ids = smol_tokenizer(TEXTS[1])["input_ids"]
    want = {name: hf_tokens(tmp_path / name, [ids])[0] for name in ("base", "merged0", "merged1")}
    assert len(set(map(tuple, want.values()))) == 3  # each adapter changes the tokens
    model = og.Model(str(base))
    adapters = og.Adapters(model)
    for i in range(2):
        adapters.load(str(tmp_path / f"a{i}.onnx_adapter"), f"a{i}")
    for name in ("a0", "a1", None, "a0", None, "a1"):
        got = genai_tokens(model, ids, adapters, name)
        assert got == want[f"merged{name[1]}" if name else "base"], name


@pytest.mark.slow
def test_int4_and_int8_are_the_runtime_s_quantized_matmuls(smol_tokenizer, tmp_path):
    import onnx

    make_family(tmp_path, "LlamaForCausalLM", smol_tokenizer)
    sizes = {}
    for outtype in ("fp32", "int8", "int4"):
        out = onnx_export.write_onnx(tmp_path / "merged0", tmp_path / outtype, outtype)
        sizes[outtype] = files.tree_size(out)
        ops = {
            n.op_type
            for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
        }
        assert ("MatMulNBits" in ops) == (outtype != "fp32"), outtype
        ids = smol_tokenizer(TEXTS[0])["input_ids"]
        assert len(genai_tokens(og.Model(str(out)), ids)) == N_NEW
    # the tiny model is mostly its tied 49152 x 64 embedding: int8 unties it into an fp32 Gather
    # (8-bit Gather is not supported) plus an int8 LM head, so only int4 is smaller here;
    # SmolLM2's sizes per outtype are in docs/deploy.md
    assert sizes["int4"] < sizes["fp32"]


def test_int4_base_keeps_fp32_lora_inputs_that_switch(smol_tokenizer, tmp_path):
    make_family(tmp_path, "LlamaForCausalLM", smol_tokenizer)
    base = onnx_export.write_onnx(
        tmp_path / "base", tmp_path / "onnx", "int4", lora_from=tmp_path / "adapter0"
    )
    slots = onnx_export.lora_inputs(base)
    assert len(slots) == 2 * 7 * 2 and all(
        isinstance(s[1 if ".lora_A." in k else 0], str) for k, s in slots.items()
    )
    onnx_export.write_onnx_adapter(tmp_path / "adapter0", base, tmp_path / "a.onnx_adapter")
    model = og.Model(str(base))
    adapters = og.Adapters(model)
    adapters.load(str(tmp_path / "a.onnx_adapter"), "a")
    ids = smol_tokenizer(TEXTS[1])["input_ids"]
    plain, tuned = genai_tokens(model, ids), genai_tokens(model, ids, adapters, "a")
    assert plain != tuned and genai_tokens(model, ids) == plain


def test_refusals_are_one_line(smol_tokenizer, tmp_path, capsys):
    save_arch_model("Gemma3ForCausalLM", tmp_path / "gemma3", smol_tokenizer)
    argv = [
        "export",
        "--model",
        str(tmp_path / "gemma3"),
        "--format",
        "onnx",
        "-o",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    assert "Gemma3ForCausalLM cannot be exported to ONNX: the builder reads" in one_error_line(
        capsys, "export"
    )
    argv[2], argv[-1] = str(tmp_path / "gemma3"), str(tmp_path / "o")
    assert main([*argv, "--outtype", "fp16"]) == 2
    assert "'fp16' not supported on CPU (fp16 runs on GPUs only" in one_error_line(capsys, "export")
    with pytest.raises(
        onnx_export.ONNXExportError, match="GPTNeoXForCausalLM not supported .*Qwen3"
    ):
        onnx_export.check_exportable({"architectures": ["GPTNeoXForCausalLM"]}, "fp32")
    assert os.listdir(tmp_path) == ["gemma3"]


def test_missing_runtime_package_names_the_extra(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_genai(name, *args, **kwargs):
        if name.startswith("onnxruntime_genai"):
            raise ImportError("No module named 'onnxruntime_genai'", name="onnxruntime_genai")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_genai)
    with pytest.raises(
        onnx_export.ONNXExportError,
        match=r"onnxruntime_genai is missing\): pip install 'lorafuse\[export\]'",
    ):
        onnx_export._builder()


def test_disk_full_leaves_nothing(smol_tokenizer, tmp_path, capsys):
    make_family(tmp_path / "m", "LlamaForCausalLM", smol_tokenizer)
    with small_tmpfs(tmp_path / "disk", files.tree_size(tmp_path / "m" / "base") // 2) as disk:
        argv = ["export", "--model", str(tmp_path / "m" / "base"), "--format", "onnx", "-o",
                str(disk / "onnx")]  # fmt: skip
        assert main(argv) == 2
        assert f"disk full writing the ONNX model to {disk / 'onnx'}: " in one_error_line(
            capsys, "export"
        )
        assert os.listdir(disk) == []
