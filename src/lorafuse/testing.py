"""Test helpers shared by lorafuse's own tests (and usable by anyone testing fused ops): the one home.

* ``assert_close`` reports max/mean difference and where;
* ``available_backends`` / ``op_cases`` list the kernel backends that run here (pytest params);
* ``FakeQuant`` is a quantized weight for the ops' quantized-weight protocol; ``nf4_dense_copies``
  records the dense copies real NF4 weights hand out;
* ``tiny_llama_config`` is the one tiny Llama shape; ``save_tiny_model`` writes it as a stock HF
  model dir with a tokenizer (``chat_tokenizer``: byte-level BPE + ChatML template, or
  ``word_tokenizer``: word-level, no pad token), ``save_tiny_adapter`` a stock PEFT adapter with
  non-zero B, ``make_tiny_workspace`` a base + two adapters + a training-checkpoint dir;
* ``single_thread`` is the body of an autouse fixture for tiny-model tests;
* ``interleaved_medians`` times functions against each other for the benchmarks;
* ``within_fp32_sum_bound`` checks a low-precision product against float64 (fp32 sums, one
  rounding);
* ``build_tiny_sd`` / ``save_tiny_sd``: tiny random SD1.5- and SDXL-shaped pipelines (in memory,
  as a diffusers dir, and as an original single-file checkpoint), ``tiny_clip_tokenizer`` a CLIP
  tokenizer built without files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import statistics
import time
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
    ours_err, stock_err = rms_error(ours, oracle), rms_error(stock, oracle)
    assert ours_err <= factor * stock_err, (
        f"{name}: ours is {ours_err:.3e} (rms) from the fp32 oracle, stock {stock_err:.3e}: "
        f"more than {factor}x"
    )


def rms_error(t: torch.Tensor, oracle: torch.Tensor) -> float:
    """Root-mean-square distance of ``t`` from ``oracle``, both read in fp32."""
    return float((t.float() - oracle.float()).pow(2).mean().sqrt())


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


def needs_cpp(test):
    """Decorator: marker ``cpp``, and a skip where the C++ extension is not built (no compiler)."""
    import pytest

    built = "cpp" in available_backends("cpu")
    return pytest.mark.cpp(pytest.mark.skipif(not built, reason="C++ extension not built")(test))


def grad_fn_names(y: torch.Tensor, depth: int = 3) -> list[str]:
    """Names of the autograd nodes within ``depth`` steps of ``y`` (its grad_fn first): which
    Function a call went through."""
    names, frontier = [], [y.grad_fn]
    for _ in range(depth):
        frontier = [f for f in frontier if f is not None]
        names += [f.name() for f in frontier]
        frontier = [n for f in frontier for n, _ in f.next_functions]
    return names


def assert_close_to_fp32_oracle(y, grads, reference, inputs, g, tol: float) -> None:
    """``y`` and ``grads`` (those of the ``inputs`` that require grad, in order) against
    ``reference(*inputs)`` recomputed in fp32 (None inputs passed through), each within ``tol``
    of its own scale."""
    f = [t.detach().float().requires_grad_(t.requires_grad) if t is not None else None
         for t in inputs]  # fmt: skip
    ry = reference(*f)
    oracle = torch.autograd.grad(ry, [t for t in f if t is not None and t.requires_grad], g.float())
    assert_close(y, ry, atol=tol * ry.abs().max().item(), rtol=tol, name="y")
    for a, e in zip(grads, oracle):
        assert_close(a, e, atol=tol * e.abs().max().item(), rtol=tol, name="grad")


def saved_bytes(fn, params):
    """``(bytes, fn())``: bytes of the unique tensor storages autograd saves while running ``fn``,
    excluding the storages of ``params`` (weights are resident anyway; saving a reference to them
    costs nothing)."""
    resident = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in resident:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` (for the test's duration) so each call appends to the returned list."""
    calls, original = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


class FakeQuant:
    """The quantized-weight protocol: ``.shape`` and ``.dequantize(dtype)``, counting calls and
    the dense copies alive at once over every FakeQuant (``FakeQuant.peak_alive`` since the last
    ``FakeQuant.reset_alive()``), so a test can check that no more than one exists at a time."""

    alive = 0
    peak_alive = 0

    def __init__(self, dense: torch.Tensor):
        self._dense = dense
        self.shape = dense.shape
        self.calls = 0

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        import weakref

        self.calls += 1
        out = self._dense.to(dtype).clone()
        FakeQuant.alive += 1
        FakeQuant.peak_alive = max(FakeQuant.peak_alive, FakeQuant.alive)
        weakref.finalize(out, FakeQuant._release)
        return out

    @staticmethod
    def _release() -> None:
        FakeQuant.alive -= 1

    @staticmethod
    def reset_alive() -> None:
        FakeQuant.peak_alive = FakeQuant.alive


@contextlib.contextmanager
def nf4_dense_copies():
    """Inside the block, the bytes of every dense copy an NF4 weight hands out (whole, rows or
    columns), appended to the yielded list."""
    from lorafuse.models.nf4 import NF4Weight

    sizes: list[int] = []
    originals = {name: getattr(NF4Weight, name) for name in ("dequantize", "dequantize_columns")}

    def record(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            sizes.append(out.numel() * out.element_size())
            return out

        return wrapped

    for name, fn in originals.items():
        setattr(NF4Weight, name, record(fn))
    try:
        yield sizes
    finally:
        for name, fn in originals.items():
            setattr(NF4Weight, name, fn)


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


def within_fp32_sum_bound(y, x, w, bias=None) -> bool:
    """Whether ``y`` is ``x·wᵀ + bias`` summed in fp32 and rounded once to ``y``'s dtype: within
    fp32 summation's error bound (k·2⁻²⁴·Σ|x||w|, the bias one more term) plus one ulp of ``y``'s
    dtype, against the float64 product. NaN outputs must be where float64 has them."""
    x64, w64 = x.double(), w.double()
    b64 = torch.zeros(()) if bias is None else bias.double()
    expect = x64 @ w64.t() + b64
    magnitude = x64.abs() @ w64.abs().t() + b64.abs()
    info = torch.finfo(y.dtype)
    ulp = torch.exp2(
        torch.floor(torch.log2(expect.abs().clamp_min(info.tiny))) + math.log2(info.eps)
    )
    bound = ulp + (x.shape[-1] + 1) * 2.0**-24 * magnitude
    nan = expect.isnan()
    if not torch.equal(y.isnan(), nan):
        return False
    return bool(((y.double() - expect).abs() <= bound)[~nan].all())


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per function over ``repeats`` rounds that call each once, after one
    warmup call each: interleaved, so a noisy shared machine's phases hit all of them alike."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


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


# ---- tiny Stable Diffusion models on disk (image LoRA) ---------------------------------------

# SD's noise schedule (both families train on it); the pipelines sample with PNDM (SD1.5) / Euler
# (SDXL) as the released models do, and training builds a DDPMScheduler from the same config.
_SD_SCHEDULE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                    num_train_timesteps=1000)  # fmt: skip


def tiny_clip_tokenizer(model_max_length: int = 77):
    """A CLIP BPE tokenizer built in memory (no files): every byte char with and without ``</w>``.

    No merges, so words split into characters (514 tokens); ids, padding to 77 and
    ``<|startoftext|>``/``<|endoftext|>`` behave like the real CLIP tokenizer's.
    """
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {tok: i for i, tok in enumerate(chars + [c + "</w>" for c in chars])}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def _tiny_clip(tok, *, hidden: int, projection: bool, projection_dim: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=len(tok), max_position_embeddings=77,
        projection_dim=projection_dim, hidden_act="gelu" if projection else "quick_gelu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


def _tiny_unet(family: str):
    """SD1.5 shape: 1x1-conv proj_in/out, 2 levels; SDXL shape: linear proj, text_time, 3 levels.

    Both have ResNet blocks (with conv_shortcut where channels change), a Downsample and an
    Upsample, cross-attention transformer blocks in the down, mid and up blocks. Channels are
    multiples of 32 (GroupNorm's 32 groups). A forward at 8x8 latents takes milliseconds.
    """
    from diffusers import UNet2DConditionModel

    if family == "sd15":
        return UNet2DConditionModel(
            sample_size=8, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, use_linear_projection=False,
        )  # fmt: skip
    # SDXL: like the real one, level 0 has no attention, layers_per_block=2 (the SGM numbering
    # kohya writes depends on it), several transformer layers in the last level, cross-attention
    # on te1 + te2 hidden states (32 + 64), and the micro-conditioning input: te2's pooled
    # projection (32) + 6 size/crop values x 8 = 80.
    return UNet2DConditionModel(
        sample_size=8, block_out_channels=(32, 64, 64), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2), cross_attention_dim=96,
        attention_head_dim=(2, 4, 8), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=80,
    )  # fmt: skip


def build_tiny_sd(family: str = "sd15", prediction_type: str = "epsilon", seed: int = 0):
    """The tiny random pipeline of :func:`save_tiny_sd` in memory (fp32, eval mode)."""
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        PNDMScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
    )

    if family not in ("sd15", "sdxl"):
        raise ValueError(f"family must be 'sd15' or 'sdxl', got {family!r}")
    torch.manual_seed(seed)
    unet = _tiny_unet(family).eval()
    vae = AutoencoderKL(
        block_out_channels=(32, 64), latent_channels=4, sample_size=64,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.13025 if family == "sdxl" else 0.18215,
    ).eval()  # fmt: skip
    tok = tiny_clip_tokenizer()
    if family == "sd15":
        sched = PNDMScheduler(
            **_SD_SCHEDULE, skip_prk_steps=True, prediction_type=prediction_type, steps_offset=1
        )
        return StableDiffusionPipeline(
            vae=vae, text_encoder=_tiny_clip(tok, hidden=32, projection=False), tokenizer=tok,
            unet=unet, scheduler=sched, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )  # fmt: skip
    sched = EulerDiscreteScheduler(**_SD_SCHEDULE, prediction_type=prediction_type, steps_offset=1)
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=_tiny_clip(tok, hidden=32, projection=False), tokenizer=tok,
        # te2 wider than te1, as on SDXL (768 / 1280): diffusers' single-file loader tells the
        # two apart by their position-embedding width
        text_encoder_2=_tiny_clip(tok, hidden=64, projection=True),
        tokenizer_2=tiny_clip_tokenizer(), unet=unet, scheduler=sched,
    )  # fmt: skip


def _vae_to_ldm(sd: dict) -> dict:
    """Diffusers AutoencoderKL state dict -> the LDM ``first_stage_model`` layout (attention
    q/k/v/proj_out as 1x1 convs, decoder levels numbered from the bottom)."""
    n_up = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("decoder.up_blocks."))
    out = {}
    for key, v in sd.items():
        k = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        k = re.sub(r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", k)
        k = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", k)
        k = re.sub(r"up_blocks\.(\d+)\.resnets\.",
                   lambda m: f"up.{n_up - 1 - int(m[1])}.block.", k)  # fmt: skip
        k = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0\.",
                   lambda m: f"up.{n_up - 1 - int(m[1])}.upsample.", k)  # fmt: skip
        k = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", k)
        if ".mid_block.attentions.0." in k:
            k = k.replace("mid_block.attentions.0.", "mid.attn_1.").replace("group_norm", "norm")
            for a, b in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
                k = k.replace(f".{a}.", f".{b}.")
            if v.dim() == 2:
                v = v[:, :, None, None]  # (out, in) -> (out, in, 1, 1) conv
        out["first_stage_model." + k] = v
    return out


def _open_clip_to_ldm(sd: dict, prefix: str) -> dict:
    """transformers CLIPTextModelWithProjection -> OpenCLIP layout (SDXL's second encoder):
    fused ``in_proj`` q/k/v, ``text_projection`` stored transposed (width, proj)."""
    out = {prefix + "text_projection": sd["text_projection.weight"].T.contiguous()}
    names = {"embeddings.token_embedding.weight": "token_embedding.weight",
             "embeddings.position_embedding.weight": "positional_embedding",
             "final_layer_norm.weight": "ln_final.weight", "final_layer_norm.bias": "ln_final.bias"}  # fmt: skip
    layers = {}
    for key, v in sd.items():
        k = key.removeprefix("text_model.")
        if k in names:
            out[prefix + names[k]] = v
        elif k.startswith("encoder.layers."):
            n, rest = k[len("encoder.layers.") :].split(".", 1)
            layers.setdefault(int(n), {})[rest] = v
    for n, p in layers.items():
        base = f"{prefix}transformer.resblocks.{n}."
        for part in ("weight", "bias"):
            qkv = [p[f"self_attn.{x}_proj.{part}"] for x in "qkv"]
            out[f"{base}attn.in_proj_{part}"] = torch.cat(qkv)  # (3*width, width) / (3*width,)
            for ours, theirs in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                                 ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"),
                                 ("mlp.fc2", "mlp.c_proj")):  # fmt: skip
                out[f"{base}{theirs}.{part}"] = p[f"{ours}.{part}"]
    return out


_UNET_TOP = {"time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
             "add_embedding.linear_1.": "label_emb.0.0.", "add_embedding.linear_2.": "label_emb.0.2.",
             "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2."}  # fmt: skip
_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0",
                "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                "conv_shortcut": "skip_connection"}  # fmt: skip


def _unet_to_ldm(sd: dict, config) -> dict:
    """Diffusers UNet state dict -> the original LDM/SGM ``model.diffusion_model`` layout (the
    inverse of diffusers' ``convert_ldm_unet_checkpoint``; L = layers per block): down block b,
    layer i -> ``input_blocks.{1 + b(L+1) + i}.0|1``, its Downsample ``.{1 + b(L+1) + L}.0.op``;
    mid -> ``middle_block.0|1|2``; up -> ``output_blocks.{b(L+1) + i}.0|1``, Upsample at
    ``.{b(L+1) + L}.2`` (``.1`` in a block without attention). Written independently of
    :mod:`lorafuse.image.kohya`, whose LoRA names tests check against it."""
    L = config["layers_per_block"]
    up_attn = ["CrossAttn" in t for t in config["up_block_types"]]
    subs = [
        (r"^(.*resnets\.\d+\.)(norm1|conv1|norm2|conv2|time_emb_proj|conv_shortcut)\.",
         lambda m: f"{m[1]}{_UNET_RESNET[m[2]]}."),
        (r"^down_blocks\.(\d+)\.resnets\.(\d+)\.",
         lambda m: f"input_blocks.{1 + int(m[1]) * (L + 1) + int(m[2])}.0."),
        (r"^down_blocks\.(\d+)\.attentions\.(\d+)\.",
         lambda m: f"input_blocks.{1 + int(m[1]) * (L + 1) + int(m[2])}.1."),
        (r"^down_blocks\.(\d+)\.downsamplers\.0\.conv\.",
         lambda m: f"input_blocks.{1 + int(m[1]) * (L + 1) + L}.0.op."),
        (r"^mid_block\.resnets\.(\d+)\.", lambda m: f"middle_block.{2 * int(m[1])}."),
        (r"^mid_block\.attentions\.0\.", lambda m: "middle_block.1."),
        (r"^up_blocks\.(\d+)\.resnets\.(\d+)\.",
         lambda m: f"output_blocks.{int(m[1]) * (L + 1) + int(m[2])}.0."),
        (r"^up_blocks\.(\d+)\.attentions\.(\d+)\.",
         lambda m: f"output_blocks.{int(m[1]) * (L + 1) + int(m[2])}.1."),
        (r"^up_blocks\.(\d+)\.upsamplers\.0\.",
         lambda m: f"output_blocks.{int(m[1]) * (L + 1) + L}.{2 if up_attn[int(m[1])] else 1}."),
    ]  # fmt: skip
    out = {}
    for key, v in sd.items():
        k = next(
            (new + key[len(old) :] for old, new in _UNET_TOP.items() if key.startswith(old)), key
        )
        for pattern, repl in subs:
            k = re.sub(pattern, repl, k)
        out["model.diffusion_model." + k] = v
    return out


def sd_single_file_state_dict(pipe, family: str) -> dict:
    """A diffusers SD1.5/SDXL pipeline as an original single-file checkpoint (LDM for SD1.x,
    SGM for SDXL): the layout ``from_single_file`` converts back."""
    out = _unet_to_ldm(pipe.unet.state_dict(), pipe.unet.config)
    out.update(_vae_to_ldm(pipe.vae.state_dict()))
    te1 = pipe.text_encoder.state_dict()
    prefix = "conditioner.embedders.0." if family == "sdxl" else "cond_stage_model."
    for key, v in te1.items():
        out[f"{prefix}transformer.text_model.{key.removeprefix('text_model.')}"] = v
    if family == "sdxl":
        out.update(
            _open_clip_to_ldm(pipe.text_encoder_2.state_dict(), "conditioner.embedders.1.model.")
        )
    return {k: v.detach().contiguous() for k, v in out.items()}


def save_tiny_sd(
    path: str | os.PathLike,
    family: str = "sd15",
    prediction_type: str = "epsilon",
    single_file: bool = False,
    seed: int = 0,
) -> str:
    """Write a tiny random SD1.5- or SDXL-shaped pipeline as a diffusers dir; returns its path.

    ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline.from_pretrained(path)`` load it
    offline. Deterministic from ``seed``. ``prediction_type="v_prediction"`` gives an SD2-v-like
    scheduler config. ``single_file=True`` also writes the same weights as an original
    single-file checkpoint ``<path>.safetensors`` and returns that file's path (``path`` is then
    its config dir: ``from_single_file(file, config=path)``).
    """
    from safetensors.torch import save_file

    pipe = build_tiny_sd(family, prediction_type, seed)
    pipe.save_pretrained(Path(path), safe_serialization=True)
    if not single_file:
        return str(path)
    file = Path(path).with_name(Path(path).name + ".safetensors")
    save_file(sd_single_file_state_dict(pipe, family), str(file))
    return str(file)


# ---- image folders for lorafuse train-image ---------------------------------------------------


def write_image(path: str | os.PathLike, size: tuple[int, int] = (64, 64), seed: int = 0) -> str:
    """A small deterministic RGB image (smooth gradients + a seeded colour blob), any PIL format
    by extension. Returns the path."""
    import numpy as np
    from PIL import Image

    w, h = size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(4, max(5, min(w, h) / 2))
    blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
    base = rng.uniform(0, 1, 3)
    img = np.stack([(base[c] * (xx / w) + (1 - base[c]) * (yy / h)) * 0.6 + blob * rng.uniform(0, 0.4)
                    for c in range(3)], axis=-1)  # fmt: skip
    Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).save(path)
    return str(path)


def make_image_folder(root: str | os.PathLike, concepts: dict[str, list], seed: int = 0) -> str:
    """``concepts``: folder name (``N_concept``) -> list of ``(file name, (w, h), caption or None)``;
    writes each image (:func:`write_image`) and its ``.txt`` caption. Returns ``root``."""
    root = Path(root)
    for i, (folder, images) in enumerate(concepts.items()):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for j, (name, size, caption) in enumerate(images):
            write_image(root / folder / name, size, seed=seed * 1000 + i * 100 + j)
            if caption is not None:
                (root / folder / name).with_suffix(".txt").write_text(caption + "\n")
    return str(root)
