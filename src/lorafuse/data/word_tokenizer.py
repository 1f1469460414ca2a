"""A word-level tokenizer built without files (vocabulary < 128, eos but no pad token, a ChatML-like
template): for synthetic models, in the benchmarks' TRL runs and the tests' tiny models."""

from __future__ import annotations

_WORD_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_WORDS = (
    "the a is of and to in what which how many user assistant system answer question hello "
    "world yes no one two three four five six seven eight nine ten plus minus equals capital "
    "france paris city red blue green color sky sun moon cat dog"
).split()
_WORD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def word_tokenizer():
    """A word-level fast tokenizer (vocab < 128) with eos but no pad token, and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_WORD_SPECIALS + _WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    tok.chat_template = _WORD_TEMPLATE
    return tok
