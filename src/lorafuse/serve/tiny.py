"""Tiny random Llama models with a real byte-level BPE tokenizer and a ChatML chat template.

Used by the export/serve/eval tests and for smoke-testing the CLI without any download:
``save_tiny_model(dir)`` writes a stock Hugging Face model directory (config, safetensors,
tokenizer.json + tokenizer_config.json with a chat template, generation_config.json) and
``save_tiny_adapter(model_dir, out_dir)`` a stock PEFT LoRA adapter with non-zero B, so
base and adapter outputs differ.
"""

from __future__ import annotations

import os
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "user assistant system hello world answer question 0123456789",
    "LoRA adapters are merged into the base weights; GGUF files load in llama.cpp.",
]


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (GPT-2 style, like SmolLM2's) of ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path: str | os.PathLike, seed: int = 0, max_shard_size: str = "40KB", **cfg):
    """Write a tiny random Llama + tokenizer to ``path``; returns ``(model, tokenizer)``.

    The small ``max_shard_size`` makes the checkpoint sharded (index + several files) so merge
    is tested on the sharded layout real models use.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    config.update(cfg)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    # Random init has tiny weights -> near-uniform logits; scale so greedy choices are decisive
    # and argmax comparisons (GGUF round trip, merge) are meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20.0)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    path = Path(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def save_tiny_adapter(model_dir, out_dir, seed: int = 1, r: int = 4, target_modules=None):
    """Write a PEFT LoRA adapter for the model in ``model_dir`` with random (non-zero) A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = target_modules or [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():  # make the adapter's effect large enough to change greedy outputs
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(5.0)
    peft_model.save_pretrained(out_dir)
    return peft_model


def make_tiny_workspace(root) -> dict:
    """base model dir + two adapters + a training-checkpoint-style dir (interface C) under ``root``."""
    import json
    import shutil

    root = Path(root)
    save_tiny_model(root / "base")
    save_tiny_adapter(root / "base", root / "adapter_a", seed=1)
    save_tiny_adapter(
        root / "base", root / "adapter_b", seed=2, target_modules=["q_proj", "v_proj"]
    )
    ckpt = root / "run" / "final"
    shutil.copytree(root / "adapter_a", ckpt)
    cfg = {
        "model": str(root / "base"),
        "max_seq_length": 512,
        "dtype": "float32",
        "load_in_4bit": False,
    }
    (ckpt / "lorafuse_config.json").write_text(json.dumps(cfg))
    build_tokenizer().save_pretrained(ckpt)
    return {"root": root, "base": root / "base", "adapter_a": root / "adapter_a",
            "adapter_b": root / "adapter_b", "checkpoint": ckpt}  # fmt: skip
