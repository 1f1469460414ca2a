"""Tiny language models on disk: the one tiny Llama shape, tokenizers built without files, a stock HF model dir, a stock PEFT adapter with non-zero B, a UI workspace."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from lorafuse.data.word_tokenizer import word_tokenizer


def tiny_llama_config(**overrides):
    """The one tiny Llama shape of the test suite (2 layers, hidden 64, GQA 4/2 heads)."""
    from transformers import LlamaConfig

    cfg = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "user assistant system hello world answer question 0123456789",
    "LoRA adapters are merged into the base weights; GGUF files load in llama.cpp.",
]


def chat_tokenizer(vocab_size: int = 320):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (GPT-2 style, like SmolLM2's) with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_CHAT_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


TOKENIZERS = {"chat": chat_tokenizer, "words": word_tokenizer}
# The plain variant the loader tests use: word tokenizer (no pad token), init-scale weights, one file
PLAIN = {"tokenizer": "words", "scale": 1.0, "max_shard_size": "1GB"}


def save_tiny_model(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    tokenizer: str | None = "chat",
    scale: float = 20.0,
    max_shard_size: str = "40KB",
    **config,
):
    """Write a tiny random Llama (+ tokenizer) as a stock HF dir at ``path``; returns (model, tok).

    ``tokenizer``: ``"chat"`` | ``"words"`` | None (no tokenizer files). ``scale`` multiplies the
    2-D weights: random init has tiny weights and near-uniform logits, so the default makes greedy
    choices decisive and argmax comparisons (GGUF round trip, merge, serve) meaningful. The small
    ``max_shard_size`` makes the checkpoint sharded (index + several files), as real models are.
    ``config`` overrides :func:`tiny_llama_config`.
    """
    from transformers import GenerationConfig, LlamaForCausalLM

    tok = TOKENIZERS[tokenizer]() if tokenizer else None
    cfg = {"max_position_embeddings": 512}
    if tok is not None:
        cfg.update(vocab_size=max(128, len(tok)), bos_token_id=tok.bos_token_id,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    cfg.update(config)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**cfg)).float().eval()
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(scale)
    if tok is not None:
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    model.save_pretrained(Path(path), max_shard_size=max_shard_size)
    if tok is not None:
        tok.save_pretrained(Path(path))
    return model, tok


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_tiny_adapter(model_dir, out_dir, seed: int = 1, r: int = 4, target_modules=None):
    """Write a PEFT LoRA adapter for the model in ``model_dir`` with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=target_modules or LORA_TARGETS,
                     init_lora_weights=False)  # fmt: skip
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():  # make the adapter's effect large enough to change greedy outputs
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(5.0)
    peft_model.save_pretrained(out_dir)
    return peft_model


def make_tiny_workspace(root) -> dict:
    """A base model dir, two adapters and a training-checkpoint dir (with its stored config)."""
    root = Path(root)
    save_tiny_model(root / "base")
    save_tiny_adapter(root / "base", root / "adapter_a", seed=1)
    save_tiny_adapter(
        root / "base", root / "adapter_b", seed=2, target_modules=["q_proj", "v_proj"]
    )
    ckpt = root / "run" / "final"
    shutil.copytree(root / "adapter_a", ckpt)
    cfg = {"model": str(root / "base"), "max_seq_length": 512, "dtype": "float32",
           "load_in_4bit": False}  # fmt: skip
    (ckpt / "lorafuse_config.json").write_text(json.dumps(cfg))
    chat_tokenizer().save_pretrained(ckpt)
    return {"root": root, "base": root / "base", "adapter_a": root / "adapter_a",
            "adapter_b": root / "adapter_b", "checkpoint": ckpt}  # fmt: skip
