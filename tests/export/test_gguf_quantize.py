"""Quantized GGUF outtypes made by llama.cpp's own quantizer (cyllama's ``model_quantize``), read
back by llama.cpp: the file type is the one asked for, the file is smaller than f32, it loads and
generates; K-quant fallbacks (rows not a multiple of 256) are reported; a bad outtype is refused
with the valid names and nothing (not even the intermediate) is left behind.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from test_gguf_llamacpp import LlamaCpp  # same directory (rootdir import mode)

from lorafuse.export.gguf_export import QUANTIZED, write_gguf
from lorafuse.testing import save_tiny_model
from lorafuse.testing.arch_families import ARCH_CASES, save_arch_model

F = gguf.LlamaFileType
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")  # fmt: skip
# a fixed English text for teacher-forced agreement (not a repo file, which would change)
TEXT = (
    "The river rises in the hills north of the town and runs south through farmland for about "
    "forty miles before it reaches the sea. In the spring the water is high and fast, and the old "
    "stone bridge near the mill has been closed twice in the last ten years. Most of the people "
    "who live along the river are farmers, although a few families still fish for trout and "
    "salmon. The town council has asked the government for money to repair the bridge, to build "
    "a new school, and to improve the road that connects the town to the railway station."
)


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory, smol_tokenizer):
    """A tiny random Llama whose widths are multiples of 256 (no K-quant fallback), SmolLM2's tokenizer."""
    root = tmp_path_factory.mktemp("wide")
    tok = smol_tokenizer
    save_tiny_model(root, vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, max_shard_size="200MB")  # fmt: skip
    for name in TOKENIZER_FILES:
        (root / name).unlink(missing_ok=True)
    tok.save_pretrained(root)
    return root


def _teacher_forced_logits(llm: LlamaCpp, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) logits, each centred (llama.cpp's softmax ignores a constant shift)."""
    import cyllama.llama.llama_cpp as cy

    llm.ctx.kv_cache_clear()
    rows = []
    for i, t in enumerate(ids):
        llm.ctx.decode(cy.llama_batch_get_one([t], i))
        rows.append(np.asarray(llm.ctx.get_logits(), dtype=np.float64).copy())
    logits = np.stack(rows)
    return logits - logits.mean(axis=1, keepdims=True)


def _teacher_forced_top1(llm: LlamaCpp, ids: list[int]) -> np.ndarray:
    return _teacher_forced_logits(llm, ids).argmax(axis=1)


# q4_k_m in the quick suite; the others (~40 s each on a loaded 2-core CPU) with the slow ones
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "outtype", ["q4_k_m", pytest.param("q4_0", marks=SLOW), pytest.param("q6_k", marks=SLOW)]
)
def test_quantized_outtype_loads_with_its_file_type(wide_tiny, smol_tokenizer, tmp_path, outtype):
    import warnings

    f32 = write_gguf(wide_tiny, tmp_path / "f32.gguf", "f32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # widths are multiples of 256: no fallback to report
        path = write_gguf(wide_tiny, tmp_path / f"{outtype}.gguf", outtype)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["f32.gguf", f"{outtype}.gguf"])
    assert path.stat().st_size < f32.stat().st_size / 4
    llm = LlamaCpp(path)
    assert int(llm.model.meta_val_str("general.file_type")) == int(QUANTIZED[outtype])
    ids = smol_tokenizer("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"]
    got = _teacher_forced_top1(llm, ids)
    want = _teacher_forced_top1(LlamaCpp(f32), ids)
    # a random model's logits are near ties everywhere, so only loose agreement is expected
    # (measured 8 of 33 to 33 of 33); a garbled tensor agrees on ~0 (vocab 49152)
    assert (got == want).mean() > 0.2, (got == want).mean()


def test_k_quant_fallback_is_reported_and_the_file_loads(smol_tiny, tmp_path):
    with pytest.warns(UserWarning, match="not a multiple of 256"):
        path = write_gguf(smol_tiny / "merged", tmp_path / "tiny.gguf", "q4_k_m")
    llm = LlamaCpp(path)
    assert int(llm.model.meta_val_str("general.file_type")) == int(F.MOSTLY_Q4_K_M)
    tokens, logits = llm.greedy(llm.tokenize("What is the capital of France?"), 2)
    assert np.isfinite(logits).all() and len(tokens) == 2


def test_unknown_outtype_is_refused_before_writing(smol_tiny, tmp_path, capsys):
    from lorafuse.commands import main

    out = tmp_path / "x.gguf"
    argv = ["export", "--model", str(smol_tiny / "merged"), "--format", "gguf", "-o", str(out)]
    assert main([*argv, "--outtype", "q4_k_x"]) == 2
    err = capsys.readouterr().err
    assert "q4_k_x" in err and "q4_k_m" in err and "q6_k" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_real_smollm2_quantized_top1_agrees_with_f32(smol_tokenizer, tmp_path):
    """The built-in SmolLM2-135M-Instruct through llama.cpp: teacher-forced top-1 over ``TEXT``
    (110 positions) agrees with f32's on 0.955 (q8_0) and 0.891 (q4_k_m), measured; thresholds
    0.9 / 0.85. Greedy runs are not compared token for token: on "What is the capital of France?"
    f32's first token leads by 0.08 logits ("The" vs "L"), and q8_0 and q4_k_m both flip it."""
    from lorafuse.models.source import resolve_model_source

    src = resolve_model_source(None)
    paths = {t: write_gguf(src, tmp_path / f"{t}.gguf", t) for t in ("f32", "q8_0", "q4_k_m")}
    ids = smol_tokenizer(TEXT)["input_ids"]
    want = _teacher_forced_top1(LlamaCpp(paths["f32"]), ids)
    for outtype, threshold in (("q8_0", 0.9), ("q4_k_m", 0.85)):
        agree = (_teacher_forced_top1(LlamaCpp(paths[outtype]), ids) == want).mean()
        size = paths[outtype].stat().st_size / 2**20
        print(
            f"{outtype}: top-1 agreement with f32 {agree:.3f} over {len(ids)} tokens, {size:.0f} MiB"
        )
        assert agree > threshold, f"{outtype}: {agree:.3f}"
    print(f"f32: {paths['f32'].stat().st_size / 2**20:.0f} MiB")
    assert paths["q4_k_m"].stat().st_size < 0.25 * paths["f32"].stat().st_size


@pytest.mark.parametrize("arch", sorted(ARCH_CASES))
def test_every_family_quantizes_to_q4_k_m_close_to_its_f32(arch, smol_tokenizer, tmp_path):
    """Each architecture's own tiny model at widths that are multiples of 256 (no K-quant
    fallback) through llama.cpp's quantizer: q4_k_m's file type, size, and teacher-forced logits
    over 48 tokens pointing the way f32's do (mean cosine; measured 0.87 Gemma 2 to 0.99 Qwen2;
    top-1 is a poor check on a random model whose logits are near ties). A garbled or misnamed
    tensor gives a cosine near 0 or a file llama.cpp refuses."""
    import warnings

    case = {**ARCH_CASES[arch][1], "hidden_size": 256, "intermediate_size": 512}
    for key in ("head_dim", "query_pre_attn_scalar"):  # heads * head_dim = 256: o_proj rows too
        case.update({key: 64} if key in case else {})
    save_arch_model(arch, tmp_path / "model", smol_tokenizer, case)
    f32 = write_gguf(tmp_path / "model", tmp_path / "f32.gguf", "f32", pre="smollm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to report
        q = write_gguf(tmp_path / "model", tmp_path / "q.gguf", "q4_k_m", pre="smollm")
    assert q.stat().st_size < f32.stat().st_size / 4
    llm = LlamaCpp(q)
    assert int(llm.model.meta_val_str("general.file_type")) == int(F.MOSTLY_Q4_K_M)
    ids = smol_tokenizer(TEXT)["input_ids"][:48]
    a, b = _teacher_forced_logits(LlamaCpp(f32), ids), _teacher_forced_logits(llm, ids)
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cosine.mean() > 0.8, f"{arch}: mean cosine {cosine.mean():.3f}"
