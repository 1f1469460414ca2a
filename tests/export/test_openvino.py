"""OpenVINO exports, checked by OpenVINO GenAI itself (``LLMPipeline`` on CPU, f32 inference and
f32 KV cache): each family's fp32 IR gives transformers' fp32 greedy tokens on the merged model;
fp16 gives transformers' tokens on the same weights rounded to fp16 (the IR stores fp16 weights
and computes in f32); int8 / int4 are NNCF-compressed; an adapter file applied to the unmerged
base IR through ``openvino_genai.Adapter`` gives the merged model's tokens. Tiny random models
carrying SmolLM2's tokenizer; 6 new tokens per prompt.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_gguf_llamacpp import _hf_greedy  # same directory: on sys.path (rootdir import mode)
from test_onnx import N_NEW, TEXTS, make_family

from lorafuse import files
from lorafuse.commands import main
from lorafuse.export import openvino as ov_export
from lorafuse.testing import one_error_line, small_tmpfs
from lorafuse.testing.arch_families import ARCH_CASES, save_arch_model

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("openvino_genai", "nncf")),
    reason="pip install 'lorafuse[export]'",
)


def genai():
    """``openvino_genai``, imported on first use: importing OpenVINO changes the process for the
    tests after it (tests/conftest.py runs this file last), so collection must not import it."""
    import openvino_genai

    return openvino_genai


EXACT = dict(
    INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32", DYNAMIC_QUANTIZATION_GROUP_SIZE=0
)


def pipeline(path, adapters=None):
    kw = {"adapters": adapters} if adapters is not None else {}
    return genai().LLMPipeline(str(path), "CPU", **kw, **EXACT)


def ov_tokens(pipe, ids, adapters=None):
    import openvino as ov

    cfg = genai().GenerationConfig(max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    if adapters is not None:
        cfg.adapters = adapters
    inputs = genai().TokenizedInputs(ov.Tensor(torch.tensor([ids]).numpy()),
                                ov.Tensor(torch.ones(1, len(ids), dtype=torch.long).numpy()))  # fmt: skip
    return list(pipe.generate(inputs, cfg).tokens[0])


def hf_tokens(model_dir, ids_list, fp16_weights=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if fp16_weights:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:  # OpenVINO keeps 1-D tensors (norms, biases) in f32
                    p.copy_(p.half().float())
    return [_hf_greedy(model, ids, N_NEW)[0] for ids in ids_list]


FAST = "LlamaForCausalLM"
FAMILIES = [a if a == FAST else pytest.param(a, marks=pytest.mark.slow) for a in ov_export.FAMILIES]


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_fp32_greedy_equals_transformers_on_the_merged_model(arch, smol_tokenizer, tmp_path):
    make_family(tmp_path, arch, smol_tokenizer)
    out = ov_export.write_openvino(tmp_path / "merged0", tmp_path / "ov", "fp32")
    assert {"openvino_tokenizer.xml", "openvino_detokenizer.xml", "chat_template.jinja"} <= set(
        os.listdir(out)
    )
    ids_list = [smol_tokenizer(t)["input_ids"] for t in TEXTS]
    pipe = pipeline(out)
    assert [ov_tokens(pipe, ids) for ids in ids_list] == hf_tokens(tmp_path / "merged0", ids_list)
    assert list(pipe.get_tokenizer().encode(TEXTS[1]).input_ids.data[0]) == ids_list[1]


def test_fp16_equals_transformers_on_fp16_rounded_weights_and_int_types_compress(
    smol_tokenizer, tmp_path
):
    import openvino as ov

    make_family(tmp_path, FAST, smol_tokenizer)
    ids_list = [smol_tokenizer(t)["input_ids"] for t in TEXTS]
    out = ov_export.write_openvino(tmp_path / "merged0", tmp_path / "fp16", "fp16")
    got = [ov_tokens(pipeline(out), ids) for ids in ids_list]
    assert got == hf_tokens(tmp_path / "merged0", ids_list, fp16_weights=True)
    sizes = {"fp16": files.tree_size(out)}
    for outtype, weight_type in (("int8", "u8"), ("int4", "u4")):
        out = ov_export.write_openvino(tmp_path / "merged0", tmp_path / outtype, outtype)
        sizes[outtype] = files.tree_size(out)
        types = {op.get_output_element_type(0).get_type_name()
                 for op in ov.Core().read_model(out / "openvino_model.xml").get_ops()
                 if op.get_type_name() == "Constant"}  # fmt: skip
        assert weight_type in types, (outtype, types)
        assert len(ov_tokens(genai().LLMPipeline(str(out), "CPU"), ids_list[0])) == N_NEW
    assert sizes["int4"] < sizes["int8"] < sizes["fp16"]


def _adapters(tmp_path, arch, tok):
    make_family(tmp_path, arch, tok, adapters=[(1, 4, None), (2, 8, ARCH_CASES[arch][2][:2])])
    base = ov_export.write_openvino(tmp_path / "base", tmp_path / "ov", "fp32")
    for i in range(2):
        argv = ["export", "--model", str(tmp_path / "base"), "--adapter", str(tmp_path / f"adapter{i}"),
                "--format", "openvino-adapter", "-o", str(tmp_path / f"a{i}.safetensors")]  # fmt: skip
        assert main(argv) == 0
    return base, [genai().Adapter(str(tmp_path / f"a{i}.safetensors")) for i in range(2)]


@pytest.mark.parametrize("arch", [FAST, pytest.param("Phi3ForCausalLM", marks=pytest.mark.slow)])
def test_each_adapter_on_the_base_ir_equals_its_merged_model(arch, smol_tokenizer, tmp_path):
    """One pipeline per adapter (see the switching test below for why)."""
    base, adapters = _adapters(tmp_path, arch, smol_tokenizer)
    ids = smol_tokenizer(TEXTS[1])["input_ids"]
    for i, adapter in enumerate(adapters):
        got = ov_tokens(
            pipeline(base, genai().AdapterConfig(adapter)), ids, genai().AdapterConfig(adapter)
        )
        assert got == hf_tokens(tmp_path / f"merged{i}", [ids])[0], i
    assert ov_tokens(pipeline(base), ids) == hf_tokens(tmp_path / "base", [ids])[0]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="openvino-genai 2026.4.1: after a generate with one adapter "
                   "config, a generate with another (or none) on the same LLMPipeline gives neither "
                   "model's tokens; the first generate of a pipeline is exact")  # fmt: skip
def test_switching_adapters_on_one_pipeline(smol_tokenizer, tmp_path):
    base, (a0, _) = _adapters(tmp_path, FAST, smol_tokenizer)
    ids = smol_tokenizer(TEXTS[1])["input_ids"]
    pipe = pipeline(base, genai().AdapterConfig(a0))
    assert (
        ov_tokens(pipe, ids, genai().AdapterConfig(a0)) == hf_tokens(tmp_path / "merged0", [ids])[0]
    )
    assert ov_tokens(pipe, ids, genai().AdapterConfig()) == hf_tokens(tmp_path / "base", [ids])[0]


def test_refusals_are_one_line(smol_tokenizer, tmp_path, capsys):
    save_arch_model("Gemma2ForCausalLM", tmp_path / "gemma2", smol_tokenizer)
    argv = [
        "export",
        "--model",
        str(tmp_path / "gemma2"),
        "--format",
        "openvino",
        "-o",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    assert "Gemma2ForCausalLM cannot be exported to OpenVINO: sliding-window" in one_error_line(
        capsys, "export"
    )
    with pytest.raises(ov_export.OpenVINOExportError, match="sliding-window"):
        ov_export.check_exportable(
            {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "fp16"
        )
    with pytest.raises(ov_export.OpenVINOExportError, match="'q4_k_m' not supported"):
        ov_export.check_exportable({"architectures": ["LlamaForCausalLM"]}, "q4_k_m")
    assert os.listdir(tmp_path) == ["gemma2"]


def test_missing_runtime_package_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_nncf(name, *args, **kwargs):
        if name == "nncf":
            raise ImportError("No module named 'nncf'", name="nncf")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nncf)
    with pytest.raises(
        ov_export.OpenVINOExportError, match=r"nncf is missing\): pip install 'lorafuse\[export\]'"
    ):
        ov_export._modules()


def test_disk_full_leaves_nothing(smol_tokenizer, tmp_path, capsys):
    make_family(tmp_path / "m", FAST, smol_tokenizer)
    with small_tmpfs(tmp_path / "disk", files.tree_size(tmp_path / "m" / "base") // 2) as disk:
        argv = ["export", "--model", str(tmp_path / "m" / "base"), "--format", "openvino", "--outtype", "fp32",
                "-o", str(disk / "ov")]  # fmt: skip
        assert main(argv) == 2
        assert f"disk full writing the OpenVINO model to {disk / 'ov'}: " in one_error_line(
            capsys, "export"
        )
        assert os.listdir(disk) == []
        argv = ["export", "--model", str(tmp_path / "m" / "base"), "--adapter", str(tmp_path / "m" / "adapter0"),
                "--format", "openvino-adapter", "-o", str(disk / "a.safetensors")]  # fmt: skip
        with open(disk / "fill", "wb") as f:  # leave less room than the adapter needs
            f.write(b"\0" * (files.free_bytes(disk) - 1000))
        assert main(argv) == 2
        assert (
            f"disk full writing the OpenVINO adapter to {disk / 'a.safetensors'}: "
            in one_error_line(capsys, "export")
        )
        assert os.listdir(disk) == ["fill"]
