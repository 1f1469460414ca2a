"""A chat model exported to GGUF ends its replies where its template ends a turn, in llama.cpp
(and so in Ollama, which runs llama.cpp), for every family: the GGUF's eos / eot ids are the
tokenizer's EOS and the template's end-of-turn token, llama.cpp counts both as end of generation
and no token that opens a turn, and llama.cpp's own completion loop (llama-cpp-python), pushed to
the end-of-turn token by ``logit_bias``, stops there instead of running to ``max_tokens``. With
Go: the prompt Ollama builds from the Modelfile's TEMPLATE tokenizes in llama.cpp (BOS added as
the GGUF says) to exactly the ids of the Hugging Face chat template.
"""

from __future__ import annotations

import json

import pytest
from test_gguf_llamacpp import (  # same directory: on sys.path (rootdir import mode)
    LlamaCpp,
    _hf_greedy,
)
from test_ollama import NO_SYSTEM, SYSTEM, TRANSLATED, TURNS, _ollama_messages, _triple

from lorafuse.export.chat_formats import FORMATS
from lorafuse.export.gguf_export import write_gguf, write_modelfile
from lorafuse.export.gguf_families import FAMILIES
from lorafuse.export.gguf_vocab import adds_bos
from lorafuse.testing.chat_families import (
    ANSWER,
    CHAT_FAMILIES,
    OLDER_ARCHS,
    QUESTION,
    save_family_chat_model,
    save_family_replier,
    save_family_tokenizer,
)

# each family on its own architecture (Qwen2, Qwen3, Gemma 2/3, Phi-3, Mistral, SmolLM3), fitted
OWN = sorted(n for n, f in CHAT_FAMILIES.items()
             if f.arch in OLDER_ARCHS and f.arch != "LlamaForCausalLM")  # fmt: skip
# the late-2026 families on theirs (``new_families``), random
NEW_OWN = sorted(n for n, f in CHAT_FAMILIES.items() if f.arch not in OLDER_ARCHS)


def _n_ctx(prompt: list[int]) -> int:
    """llama.cpp's context for ``prompt`` and a short reply (SmolLM3's system block alone is
    ~1,100 tokens of the tiny tokenizer)."""
    return max(256, len(prompt) + 32)


def _export(name: str, root):
    _, tok = save_family_chat_model(name, root / "hf")
    # the tiny byte-level BPE splits as GPT-2 does (llm.chat_tokenizer)
    return write_gguf(root / "hf", root / f"{name}.gguf", "f32", pre="gpt-2"), tok


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHAT_FAMILIES))
def test_gguf_stops_at_the_end_of_turn_token_in_llama_cpp(name, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python (dev extra)")
    fam = CHAT_FAMILIES[name]
    path, tok = _export(name, tmp_path)
    eot, eos = tok.convert_tokens_to_ids(fam.eot), tok.eos_token_id
    llm = LlamaCpp(path)
    vocab = llm.vocab
    assert int(llm.model.meta_val_str("tokenizer.ggml.eot_token_id")) == eot
    assert (vocab.token_eot(), vocab.token_eos()) == (eot, eos)
    assert vocab.is_eog(eot) and vocab.is_eog(eos)
    assert vocab.get_add_bos() == fam.add_bos
    if fam.fmt:
        fmt = next(f for f in FORMATS if f.name == fam.fmt)
        opening = tok(fmt.open("user") + fmt.open("assistant"), add_special_tokens=False)
        assert not any(vocab.is_eog(t) for t in opening["input_ids"])
    prompt = tok.apply_chat_template([TURNS[0]], add_generation_prompt=True)["input_ids"]
    lcp = llama_cpp.Llama(str(path), n_ctx=_n_ctx(prompt), n_threads=2, verbose=False)
    try:
        out = lcp.create_completion(list(prompt), max_tokens=8, temperature=0.0,
                                    logit_bias={eot: 100.0})  # fmt: skip
        other = lcp.create_completion(list(prompt), max_tokens=8, temperature=0.0)
    finally:
        lcp.close()
    assert (out["choices"][0]["finish_reason"], out["choices"][0]["text"]) == ("stop", "")
    assert other["usage"]["completion_tokens"] > 0  # unpushed, the random model says something


@pytest.mark.parametrize("name", OWN)
def test_family_model_gguf_reply_ends_at_the_end_of_turn_token_in_llama_cpp(name, tmp_path):
    """A family's own architecture, fitted to answer and end its turn (``save_family_replier``):
    its f32 GGUF carries the tokenizer's eos / eot ids, llama.cpp's greedy tokens are
    transformers' reply up to and including the end-of-turn token, and llama.cpp's completion
    loop stops there with the reply's text (no logit_bias)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python (dev extra)")
    fam = CHAT_FAMILIES[name]
    model, tok = save_family_replier(name, tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / f"{name}.gguf", "f32", pre="gpt-2")
    eot, eos = tok.convert_tokens_to_ids(fam.eot), tok.eos_token_id
    prompt = list(tok.apply_chat_template([QUESTION], add_generation_prompt=True)["input_ids"])
    llm = LlamaCpp(path, n_ctx=_n_ctx(prompt))
    vocab = llm.vocab
    assert llm.model.meta_val_str("general.architecture") == FAMILIES[fam.arch].name
    assert int(llm.model.meta_val_str("tokenizer.ggml.eot_token_id")) == eot
    assert (vocab.token_eot(), vocab.token_eos()) == (eot, eos)
    assert vocab.is_eog(eot) and vocab.is_eog(eos)
    want, _ = _hf_greedy(model, prompt, len(tok(ANSWER, add_special_tokens=False)["input_ids"]) + 1)
    assert want[-1] == eot  # transformers' greedy reply ends the turn
    assert llm.greedy(prompt, len(want))[0] == want
    lcp = llama_cpp.Llama(str(path), n_ctx=_n_ctx(prompt), n_threads=2, verbose=False)
    try:
        out = lcp.create_completion(prompt, max_tokens=16, temperature=0.0)
    finally:
        lcp.close()
    text = tok.decode(want[:-1], skip_special_tokens=True)
    assert (out["choices"][0]["finish_reason"], out["choices"][0]["text"]) == ("stop", text)


@pytest.mark.parametrize("name", NEW_OWN)
def test_new_family_gguf_stops_at_the_end_of_turn_token_in_llama_cpp(name, tmp_path):
    """The late-2026 families on their own tiny architectures (random weights): the f32 GGUF
    carries the tokenizer's eos and the template's end-of-turn token, llama.cpp (llama-cpp-python,
    which runs these archs) counts both as end of generation and none of the format's
    turn-opening tokens, and its completion loop, pushed to the end-of-turn token by
    ``logit_bias``, stops there (a random model never picks it on its own)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python (dev extra)")
    from test_gguf_families_2026 import RUNNABLE

    from lorafuse.testing.new_families import save_family_model

    fam = CHAT_FAMILIES[name]
    tok = save_family_tokenizer(name, tmp_path / "hf")
    save_family_model(fam.arch, tmp_path / "hf", tok, **RUNNABLE.get(fam.arch, {}))
    tok = save_family_tokenizer(name, tmp_path / "hf")  # as the family writes it (add_bos)
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "f32", pre="gpt-2")
    eot, eos = tok.convert_tokens_to_ids(fam.eot), tok.eos_token_id
    prompt = list(tok.apply_chat_template([TURNS[0]], add_generation_prompt=True)["input_ids"])
    lcp = llama_cpp.Llama(str(path), n_ctx=_n_ctx(prompt), n_threads=2, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(lcp.model)
        assert lcp.metadata["general.architecture"] == FAMILIES[fam.arch].name
        assert int(lcp.metadata["tokenizer.ggml.eot_token_id"]) == eot
        assert (llama_cpp.llama_vocab_eot(vocab), llama_cpp.llama_vocab_eos(vocab)) == (eot, eos)
        assert llama_cpp.llama_vocab_is_eog(vocab, eot) and llama_cpp.llama_vocab_is_eog(vocab, eos)
        assert llama_cpp.llama_vocab_get_add_bos(vocab) == fam.add_bos
        if fam.fmt:
            fmt = next(f for f in FORMATS if f.name == fam.fmt)
            opening = tok(fmt.open("user") + fmt.open_gen(), add_special_tokens=False)["input_ids"]
            assert not any(llama_cpp.llama_vocab_is_eog(vocab, t) for t in opening)
        out = lcp.create_completion(prompt, max_tokens=8, temperature=0.0, logit_bias={eot: 100.0})
        other = lcp.create_completion(prompt, max_tokens=8, temperature=0.0)
    finally:
        lcp.close()
    assert (out["choices"][0]["finish_reason"], out["choices"][0]["text"]) == ("stop", "")
    assert other["usage"]["completion_tokens"] > 0  # unpushed, the random model says something


@pytest.mark.slow
@pytest.mark.parametrize("name", TRANSLATED)
def test_ollama_prompt_tokenizes_in_llama_cpp_to_the_chat_template_ids(name, go_templates,
                                                                       tmp_path):  # fmt: skip
    path, tok = _export(name, tmp_path)
    modelfile = write_modelfile(path, tmp_path / "hf").read_text()
    template = _triple(modelfile, "TEMPLATE")
    conversations = [TURNS, [SYSTEM, *TURNS]] if name not in NO_SYSTEM else [TURNS]
    cases = [{"Template": template, "Messages": _ollama_messages(modelfile, c)} for c in conversations]  # fmt: skip
    llm = LlamaCpp(path)  # holds the model the vocab belongs to
    vocab = llm.vocab
    for messages, text in zip(conversations, go_templates.render(cases)):
        got = list(vocab.tokenize(text, add_special=vocab.get_add_bos(), parse_special=True))
        want = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert got == list(want), f"{name}, {len(messages)} messages"


def test_add_bos_is_decided_as_llama_cpp_s_converter_does(tmp_path):
    bos = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
    tj = {"model": {"type": "BPE"}, "post_processor": {"type": "Sequence", "processors": [
        {"type": "ByteLevel"}, {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A"}}]}]}}  # fmt: skip
    cfg = {"bos_token": "<|begin_of_text|>"}

    def write(tokenizer: dict, config: dict) -> bool:
        (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        return adds_bos(tmp_path)

    assert write(tj, cfg)  # Llama 3: no add_bos_token; the post-processor puts BOS first
    assert not write(tj, {**cfg, "add_bos_token": False})  # the config's flag wins
    assert not write({"model": {"type": "BPE"}}, cfg)  # byte-level BPE: llama.cpp's default
    assert write({"model": {"type": "BPE", "byte_fallback": True}}, cfg)  # sentencepiece-style
