"""GGUF exports read by llama.cpp itself (the ``cyllama`` binding: a prebuilt llama.cpp from PyPI).

transformers' GGUF reader is lenient where llama.cpp is strict (an unknown ``tokenizer.ggml.pre``
is fine for the first and fatal for the second), so the exports are also loaded, tokenized and
run by llama.cpp: every outtype loads; llama.cpp tokenizes exactly as the Hugging Face tokenizer
(the check text of llama.cpp's own converter included); greedy tokens from an f32 export equal
transformers' fp32 ones on the same weights, base and with a non-zero adapter merged. The model
is the tiny random Llama of ``conftest.smol_tiny``, which carries SmolLM2's real tokenizer.
"""

from __future__ import annotations

import shutil

import cyllama.llama.llama_cpp as cy
import numpy as np
import pytest
import torch

from lorafuse.errors import LorafuseError
from lorafuse.export import gguf_pretokenizer
from lorafuse.export.gguf_export import OUTTYPES, write_gguf
from lorafuse.export.gguf_pretokenizer import CHKTXT
from lorafuse.export.gguf_vocab import GGUFExportError, read_vocab
from lorafuse.testing import save_tiny_model

PROMPTS = [
    "What is the capital of France?",
    "<|im_start|>user\nAdd 12 and 345, then 6789.<|im_end|>\n<|im_start|>assistant\n",
    "  LoRA adapters:\tmerged  into\nthe base weights (2024-07-04) -- ok?",
    "naïve café 🦙 über 東京",
]
N_NEW = 8
_LOG: list[str] = []  # llama.cpp's log lines since the last load, for failure messages


class _Model(cy.LlamaModel):
    """cyllama 0.2.18's ``LlamaContext.get_logits`` reads ``model.n_vocab``, which its
    ``LlamaModel`` lacks (AttributeError); the vocab has it."""

    @property
    def n_vocab(self) -> int:
        return self.get_vocab().n_vocab


class LlamaCpp:
    """One GGUF file in llama.cpp on the CPU: tokenize, and greedy decode with logits (a prompt
    of up to ``n_ctx`` tokens, decoded as one batch)."""

    def __init__(self, path, n_ctx: int = 256):
        cy.ggml_backend_load_all()
        cy.set_log_callback(lambda level, text: _LOG.append(text))
        _LOG.clear()
        params = cy.LlamaModelParams()
        params.n_gpu_layers = 0
        try:
            self.model = _Model(str(path), params)
        except ValueError as err:
            errors = "".join(line for line in _LOG if "error" in line.lower())
            pytest.fail(f"llama.cpp refused {path.name}: {err}\n{errors}")
        self.vocab = self.model.get_vocab()
        ctx = cy.LlamaContextParams()
        ctx.n_ctx = ctx.n_batch = ctx.n_ubatch = n_ctx
        ctx.n_threads = ctx.n_threads_batch = 2
        # f32 KV cache and no flash attention: llama.cpp's defaults (f16 cache) round every key
        # and value, which is not the fp32 computation transformers does
        ctx.type_k = ctx.type_v = 0  # GGML_TYPE_F32
        ctx.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = cy.LlamaContext(self.model, ctx)

    def tokenize(self, text: str) -> list[int]:
        return list(self.vocab.tokenize(text, add_special=False, parse_special=True))

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """``n`` greedy tokens after ``ids`` and the logits after the prompt."""
        self.ctx.kv_cache_clear()
        batch, pos, out, first = cy.llama_batch_get_one(ids, 0), len(ids), [], None
        for _ in range(n):
            self.ctx.decode(batch)  # logits of the batch's last token only
            logits = np.asarray(self.ctx.get_logits(), dtype=np.float32)  # (n_vocab,)
            first = logits if first is None else first
            out.append(int(logits.argmax()))
            batch, pos = cy.llama_batch_get_one([out[-1]], pos), pos + 1
        return out, first


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    x, out, first = torch.tensor([ids]), [], None
    with torch.no_grad():
        for _ in range(n):
            logits = model(x).logits[0, -1]  # (vocab,)
            first = logits if first is None else first
            out.append(int(logits.argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]])], dim=1)
    return out, first


def _hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("outtype", sorted(OUTTYPES))
def test_every_outtype_loads_in_llama_cpp(smol_tiny, smol_tokenizer, tmp_path, outtype):
    path = write_gguf(smol_tiny / "merged", tmp_path / f"tiny-{outtype}.gguf", outtype)
    llm = LlamaCpp(path)
    assert llm.model.meta_val_str("tokenizer.ggml.pre") == "smollm"
    assert llm.vocab.n_vocab == len(smol_tokenizer)
    # llama.cpp's own pre-tokenizer gives the Hugging Face tokenizer's ids, on the text its
    # converter uses to tell pre-tokenizers apart and on the test prompts
    for text in [CHKTXT, *PROMPTS]:
        assert llm.tokenize(text) == smol_tokenizer(text)["input_ids"], text
    tokens, logits = llm.greedy(llm.tokenize(PROMPTS[0]), 2)
    assert logits.shape == (len(smol_tokenizer),) and np.isfinite(logits).all()
    assert logits.std() > 0.1  # real activations, not an all-zero graph


def test_f32_greedy_equals_transformers_base_and_merged_adapter(smol_tiny, tmp_path, close):
    from lorafuse.commands import main

    # base: the library writer; with the adapter: the command, which merges in fp32 first
    paths = {"base": write_gguf(smol_tiny / "base", tmp_path / "base.gguf", "f32"),
             "merged": tmp_path / "merged.gguf"}  # fmt: skip
    assert main(["export", "--model", str(smol_tiny / "base"), "--adapter", str(smol_tiny / "adapter"),
                 "--format", "gguf", "--outtype", "f32", "-o", str(paths["merged"])]) == 0  # fmt: skip
    greedy = {}
    for name, path in paths.items():
        llm = LlamaCpp(path)
        model, tok = _hf(smol_tiny / name)  # transformers fp32 on the same (merged) weights
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            got, got_logits = llm.greedy(ids, N_NEW)
            want, want_logits = _hf_greedy(model, ids, N_NEW)
            assert got == want, f"{name}: {prompt!r}"
            # the same fp32 weights and math: only op-order noise (measured max 5e-5 on
            # logits of magnitude ~14; a wrong tensor or permutation moves them by O(1))
            close(torch.from_numpy(got_logits), want_logits, atol=1e-3, rtol=1e-5, name=name)
            greedy[name, prompt] = got
    # the adapter (non-zero B) must change what is generated, or "merged" would prove nothing
    assert any(greedy["base", p] != greedy["merged", p] for p in PROMPTS)


def test_unidentifiable_tokenizer_is_refused_and_nothing_is_written(tmp_path, capsys):
    save_tiny_model(tmp_path / "odd")  # a byte-level BPE trained on four sentences: no name
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(GGUFExportError) as info:
        write_gguf(tmp_path / "odd", out / "odd.gguf", "f32")
    assert isinstance(info.value, LorafuseError)
    message = str(info.value)
    assert str(tmp_path / "odd") in message and "pre-tokenizer" in message
    assert "ByteLevel" in message and "convert_hf_to_gguf" in message
    assert list(out.iterdir()) == []

    from lorafuse.commands import main  # the command: one clear line, exit status 2

    assert main(["export", "--model", str(tmp_path / "odd"), "--format", "gguf",
                 "-o", str(out / "odd.gguf")]) == 2  # fmt: skip
    assert "llama.cpp cannot identify" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_pre_tokenizer_flag_names_it_and_unknown_names_are_refused(tmp_path, capsys):
    """The tiny chat tokenizer splits as GPT-2 does: ``--pre-tokenizer gpt-2`` makes its export
    loadable; a name llama.cpp does not know stops the export before anything is written."""
    from lorafuse.commands import main

    save_tiny_model(tmp_path / "odd")
    out = tmp_path / "odd.gguf"
    argv = ["export", "--model", str(tmp_path / "odd"), "--format", "gguf", "--outtype", "f32"]
    assert main([*argv, "--pre-tokenizer", "made-up", "-o", str(out)]) == 2
    assert "made-up" in capsys.readouterr().err and not out.exists()
    assert main([*argv, "--pre-tokenizer", "gpt-2", "-o", str(out)]) == 0
    assert LlamaCpp(out).model.meta_val_str("tokenizer.ggml.pre") == "gpt-2"


def test_pre_tokenizer_is_carried_over_from_the_source_gguf(smol_tokenizer, tmp_path, monkeypatch):
    from lorafuse.models.source import convert_gguf, default_gguf_path

    converted = convert_gguf(default_gguf_path())  # has lorafuse_source.json -> the GGUF file
    monkeypatch.setattr(gguf_pretokenizer, "PRE_BY_HASH", {})  # no hash can help
    assert read_vocab(converted, len(smol_tokenizer)).pre == "smollm"
    smol_tokenizer.save_pretrained(tmp_path)  # the same tokenizer without the source file
    with pytest.raises(GGUFExportError, match="cannot identify"):
        read_vocab(tmp_path, len(smol_tokenizer))


def test_sentencepiece_style_tokenizer_loads_as_llama_default(smol_tiny, tmp_path):
    """Byte-fallback BPE (Llama 2 / Mistral): no regex split, llama.cpp's "llama" vocab with
    pre "default", as its converter writes; the file loads and tokenizes in llama.cpp."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    words = ["▁", "▁t", "he", "▁the", "▁c", "at", "▁cat", "▁s", "▁sat"]
    vocab = {p: i for i, p in enumerate(pieces + list("▁thecas") + words[1:])}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "c"), ("a", "t"), ("▁c", "at"),
              ("▁", "s"), ("▁s", "at")]  # fmt: skip
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.pre_tokenizer = None
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")  # fmt: skip
    shutil.copytree(
        smol_tiny / "base",
        tmp_path / "spm",
        ignore=shutil.ignore_patterns("tok*", "chat*", "special*"),
    )
    tok.save_pretrained(tmp_path / "spm")
    vocab_out = read_vocab(tmp_path / "spm", 49152)
    assert (vocab_out.model, vocab_out.pre) == ("llama", "default")
    llm = LlamaCpp(write_gguf(tmp_path / "spm", tmp_path / "spm.gguf", "f32"))
    assert llm.model.meta_val_str("tokenizer.ggml.pre") == "default"
    assert llm.tokenize("the cat sat") == tok("the cat sat", add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_real_smollm2_f32_export_greedy_equals_transformers(smol_tokenizer, tmp_path):
    """The built-in SmolLM2-135M-Instruct itself (converted from its GGUF, as every command does):
    exported to f32 by `lorafuse export`, run by llama.cpp, the greedy answer to chat prompts is
    transformers' fp32 one token for token."""
    from lorafuse.commands import main
    from lorafuse.models.source import resolve_model_source

    out = tmp_path / "smollm2-f32.gguf"
    assert main(["export", "--format", "gguf", "--outtype", "f32", "-o", str(out)]) == 0
    llm = LlamaCpp(out)
    assert llm.model.meta_val_str("tokenizer.ggml.pre") == "smollm"
    model, tok = _hf(resolve_model_source(None))
    for question in ("What is the capital of France?", "Name three primary colors."):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        got, _ = llm.greedy(ids, N_NEW)
        want, _ = _hf_greedy(model, ids, N_NEW)
        assert got == want, f"{question!r}: llama.cpp {tok.decode(got)!r} vs {tok.decode(want)!r}"
