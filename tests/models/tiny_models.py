"""Tiny random Llama models saved to disk with a tiny chat tokenizer, for the models tests.

A helper module imported by the models tests (kept out of conftest.py on purpose).
"""

from __future__ import annotations

import torch

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the a is of and to in what which how many user assistant system answer question hello "
    "world yes no one two three four five six seven eight nine ten plus minus equals capital "
    "france paris city red blue green color sky sun moon cat dog"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def tiny_config(**overrides):
    """Same shape as lorafuse.testing.tiny_llama_config, with the tokenizer's special ids."""
    from transformers import LlamaConfig

    cfg = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def make_tokenizer():
    """A word-level fast tokenizer (vocab < 128) with eos but no pad token, and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny_model(path, *, seed=0, tokenizer=True, config_overrides=None, **save_kwargs):
    """Save a tiny random LlamaForCausalLM (+ tokenizer) to ``path``; returns the model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config_overrides = config_overrides or {}
    model = LlamaForCausalLM(tiny_config(**config_overrides)).float()
    model.save_pretrained(path, **save_kwargs)
    if tokenizer:
        make_tokenizer().save_pretrained(path)
    return model


def make_tiny_model_dir(tmp_path_factory):
    """A fresh dir holding the tiny model + tokenizer (each test module defines the fixture)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(path)
    return path


def fp32_oracle(model):
    """An fp32 copy of ``model`` holding the same (already rounded) low-precision weights."""
    import copy

    return copy.deepcopy(model).float()


def assert_as_accurate_as_stock(ours, stock, oracle, *, name, close, factor=1.5):
    """Outputs of a lorafuse model (``ours``) vs stock transformers/PEFT on the same weights.

    fp32: equal up to summation order (1e-5). bf16/fp16: the two round at different points, so
    they are not compared with each other; each is compared with ``oracle`` (the fp32 model on the
    same rounded weights), and ours may be at most ``factor`` times as far from it as stock is
    (root-mean-square error over all elements: the max of a few thousand rounding errors is too
    noisy to compare with a ratio).
    """
    if ours.dtype == torch.float32:
        close(ours, stock, atol=1e-5, rtol=1e-5, name=name)
        return
    assert oracle.dtype == torch.float32, oracle.dtype
    rms = lambda t: float((t.float() - oracle).pow(2).mean().sqrt())  # noqa: E731
    ours_err, stock_err = rms(ours), rms(stock)
    assert ours_err <= factor * stock_err, (
        f"{name}: ours is {ours_err:.3e} (rms) from the fp32 oracle, stock {stock_err:.3e}: "
        f"more than {factor}x"
    )
