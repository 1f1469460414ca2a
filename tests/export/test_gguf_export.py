"""GGUF export: reloads through transformers' GGUF loader with the merged model's predictions.

llama.cpp itself reads the exports in test_gguf_llamacpp.py (with SmolLM2's tokenizer).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lorafuse.commands import main
from lorafuse.export.gguf_export import write_gguf, write_modelfile
from lorafuse.export.merge import merge_adapter
from lorafuse.testing import save_tiny_adapter, save_tiny_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "LoRA adapters are merged into the base weights",
    "user assistant system hello world 0123456789",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    save_tiny_model(root / "base")
    save_tiny_adapter(root / "base", root / "adapter")
    merge_adapter(root / "base", root / "adapter", root / "merged")
    return root


def _load_gguf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _predictions(model, tok, prompts=PROMPTS):
    """Next-token argmax at every position of every prompt, and the logits."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p)["input_ids"]])
            out.append(model(ids).logits[0])
    return out


def _export(ws, name, outtype, ollama=False):
    # The tiny tokenizer splits with the GPT-2 regex (a default ByteLevel pre-tokenizer) but was
    # trained here, so llama.cpp's tokenizer hashes cannot name it: say which one it is.
    path = write_gguf(ws / "merged", ws / "out" / name, outtype, pre="gpt-2")
    if ollama:
        write_modelfile(path, ws / "merged")
    return path


@pytest.fixture(scope="module")
def merged(ws):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ws / "merged", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(ws / "merged")


def test_f32_round_trip_is_exact(ws, merged, close):
    path = _export(ws, "tiny-f32.gguf", "f32", ollama=True)
    gmodel, gtok = _load_gguf(path)
    model, tok = merged
    for p in PROMPTS + ["<|im_end|> 12 Paris!"]:
        assert gtok(p)["input_ids"] == tok(p)["input_ids"], p
    assert gtok.chat_template == tok.chat_template
    assert (gtok.eos_token, gtok.bos_token, gtok.pad_token) == (
        tok.eos_token,
        tok.bos_token,
        tok.pad_token,
    )
    for a, b in zip(_predictions(gmodel, gtok), _predictions(model, tok)):
        # same fp32 weights (the q/k permutation is undone exactly), same math: only op-order noise
        close(a, b, atol=1e-4, rtol=1e-5, name="gguf f32 logits")
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert "<|im_end|>" in (path.parent / "Modelfile").read_text()


@pytest.mark.parametrize("outtype,min_agree", [("f16", 0.97), ("bf16", 0.9), ("q8_0", 0.85)])
def test_reduced_precision_agreement(ws, merged, outtype, min_agree):
    # Thresholds: the tiny model's weights are scaled x20 (decisive argmaxes), so its logits are
    # O(100) and per-element rounding (f16 2^-11, bf16 2^-8, q8_0 ~2^-8 of each 32-block's max)
    # flips only near-ties. Measured over these 112 positions: f16 1.00, bf16 0.98, q8_0 0.90;
    # a wrong permutation or tensor mapping gives ~0.01 (chance over a 320-token vocab).
    path = _export(ws, f"tiny-{outtype}.gguf", outtype)
    gmodel, gtok = _load_gguf(path)
    got = torch.cat([x.argmax(-1) for x in _predictions(gmodel, gtok)])
    want = torch.cat([x.argmax(-1) for x in _predictions(*merged)])
    agree = (got == want).float().mean().item()
    assert agree >= min_agree, f"{outtype}: argmax agreement {agree:.3f} < {min_agree}"
    assert path.stat().st_size < (ws / "out" / "tiny-f32.gguf").stat().st_size


def test_unsupported_arch_and_outtype_write_nothing(ws, tmp_path, capsys):
    assert main(["export", "--model", str(ws / "merged"), "--format", "gguf", "--outtype", "q4_k",
                 "-o", str(tmp_path / "x.gguf")]) == 2  # fmt: skip
    assert "q4_k" in capsys.readouterr().err
    other = tmp_path / "neox"
    shutil.copytree(ws / "merged", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    (other / "config.json").write_text(json.dumps(cfg))
    assert (
        main(["export", "--model", str(other), "--format", "gguf", "-o", str(tmp_path / "y.gguf")])
        == 2
    )
    assert "GPTNeoXForCausalLM" in capsys.readouterr().err
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}
    (other / "config.json").write_text(json.dumps(cfg))
    assert (
        main(["export", "--model", str(other), "--format", "gguf", "-o", str(tmp_path / "z.gguf")])
        == 2
    )
    assert "yarn" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))


def test_safetensors_export_equals_merge(ws, close):
    from safetensors.torch import load_file

    out = ws / "st"
    assert main(["export", "--model", str(ws / "base"), "--adapter", str(ws / "adapter"),
                 "--format", "safetensors", "-o", str(out)]) == 0  # fmt: skip
    a = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {
        k: v for f in sorted((ws / "merged").glob("*.safetensors")) for k, v in load_file(f).items()
    }
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
