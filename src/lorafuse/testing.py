"""Test helpers shared by lorafuse's own tests (and usable by anyone testing fused ops): the one home.

* ``assert_close`` reports max/mean difference and where;
* ``available_backends`` / ``op_cases`` list the kernel backends that run here (pytest params);
* ``FakeQuant`` is a quantized weight for the ops' quantized-weight protocol;
* ``tiny_llama_config`` is the one tiny Llama shape; ``save_tiny_model`` writes it as a stock HF
  model dir with a tokenizer (``chat_tokenizer``: byte-level BPE + ChatML template, or
  ``word_tokenizer``: word-level, no pad token), ``save_tiny_adapter`` a stock PEFT adapter with
  non-zero B, ``make_tiny_workspace`` a base + two adapters + a training-checkpoint dir;
* ``single_thread`` is the body of an autouse fixture for tiny-model tests.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def assert_close(actual, expected, *, atol, rtol, name="tensor"):
    """Like torch.testing.assert_close, but the message says max/mean difference and where."""
    actual = actual.detach()
    expected = (
        expected.detach().to(actual.dtype) if expected.dtype != actual.dtype else expected.detach()
    )
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a = actual.double()
    e = expected.double()
    diff = (a - e).abs()
    bound = atol + rtol * e.abs()
    if bool(torch.isfinite(a).all()) and bool((diff <= bound).all()):
        return
    worst = int(torch.argmax(diff - bound).item()) if diff.numel() else 0
    where = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        if diff.numel()
        else ()
    )
    raise AssertionError(
        f"{name}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}, "
        f"worst at {where}: got {a.flatten()[worst].item():.6e}, expected {e.flatten()[worst].item():.6e} "
        f"(atol={atol}, rtol={rtol}); non-finite: {int((~torch.isfinite(a)).sum())}"
    )


def fp32_oracle(model):
    """An fp32 copy of ``model`` holding the same (already rounded) low-precision weights."""
    import copy

    return copy.deepcopy(model).float()


def assert_as_accurate_as_stock(ours, stock, oracle, *, name, close=None, factor=1.5):
    """Outputs of a lorafuse model (``ours``) vs stock transformers/PEFT on the same weights.

    fp32: equal up to summation order (1e-5). bf16/fp16: the two round at different points, so
    they are not compared with each other; each is compared with ``oracle`` (the fp32 model on the
    same rounded weights), and ours may be at most ``factor`` times as far from it as stock is
    (root-mean-square error over all elements: the max of a few thousand rounding errors is too
    noisy to compare with a ratio).
    """
    if ours.dtype == torch.float32:
        (close or assert_close)(ours, stock, atol=1e-5, rtol=1e-5, name=name)
        return
    assert oracle.dtype == torch.float32, oracle.dtype
    rms = lambda t: float((t.float() - oracle).pow(2).mean().sqrt())  # noqa: E731
    ours_err, stock_err = rms(ours), rms(stock)
    assert ours_err <= factor * stock_err, (
        f"{name}: ours is {ours_err:.3e} (rms) from the fp32 oracle, stock {stock_err:.3e}: "
        f"more than {factor}x"
    )


def available_backends(device="cpu"):
    """Backends that can run on ``device`` in this test session (torch always)."""
    from lorafuse import backends

    found = ["torch"]
    if "cpp" in backends.KERNELS and backends.cpp_available():
        found.append("cpp")
    if backends.triton_runs_on(torch.device(device)):
        found.append("triton")
    return found


def op_cases(*ops: str) -> list:
    """``pytest.param(backend, device)`` for every backend that runs all ``ops`` here.

    The torch reference on CPU always; the C++ kernels on CPU (marked ``cpp``) once built; Triton
    on CPU only under ``TRITON_INTERPRET=1`` (marked ``triton``); on a CUDA machine torch and
    Triton on the GPU (marked ``gpu``), so ``pytest tests/ops -m "not cpp"`` there checks the
    real kernels.
    """
    import pytest

    from lorafuse import backends

    def has(backend):
        return all(op in backends.KERNELS.get(backend, ()) for op in ops)

    cases = [pytest.param("torch", "cpu", id="torch-cpu")]
    for b in available_backends("cpu"):
        if b != "torch" and has(b):
            cases.append(pytest.param(b, "cpu", id=f"{b}-cpu", marks=getattr(pytest.mark, b)))
    if torch.cuda.is_available():
        cases.append(pytest.param("torch", "cuda", id="torch-cuda", marks=pytest.mark.gpu))
        if backends.triton_runs_on(torch.device("cuda")) and has("triton"):
            marks = [pytest.mark.gpu, pytest.mark.triton]
            cases.append(pytest.param("triton", "cuda", id="triton-cuda", marks=marks))
    return cases


class FakeQuant:
    """The quantized-weight protocol: ``.shape`` and ``.dequantize(dtype)``, counting calls."""

    def __init__(self, dense: torch.Tensor):
        self._dense = dense
        self.shape = dense.shape
        self.calls = 0

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        self.calls += 1
        return self._dense.to(dtype).clone()


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


def single_thread():
    """Generator for an autouse fixture: run a test on one torch thread, then restore.

    Tiny models gain nothing from threads, and on a shared 2-core CI box OpenMP barriers under
    oversubscription made each tiny op ~60x slower (measured: 21 s vs 0.35 s).
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ---- tiny models on disk ---------------------------------------------------------------------

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
