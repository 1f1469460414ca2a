"""``FastLanguageModel``: load any local model, add LoRA adapters, patch them onto fused kernels.

    model, tokenizer = FastLanguageModel.from_pretrained(None, load_in_4bit=True)
    model = FastLanguageModel.get_peft_model(model, r=16)
    ... train ...; model.save_pretrained("adapter")      # a stock PEFT adapter directory

Loading decisions (source, device, dtype, quantiser, memory, time) are printed to stderr.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lorafuse import backends, heap
from lorafuse.models import (
    grad_checkpointing,
    int8,
    moe_targets,
    nf4,
    nf4_embedding,
    nf4_experts,
    preflight,
)
from lorafuse.models.attach import LoraTargets, announce, attach_lora, require_base
from lorafuse.models.loaded import LoadedModel
from lorafuse.models.source import DEFAULT_MODEL, ModelSourceError, resolve_model_source, say
from lorafuse.ops import nf4 as nf4_kernels
from lorafuse.patching import decoding, mixers, moe

LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_hf_weights(model_dir: Path, dtype: torch.dtype, auto_class=None, what: str = "weights"):
    """``auto_class.from_pretrained`` (default: a causal LM) with a one-line error naming the files."""
    if auto_class is None:
        from transformers import AutoModelForCausalLM as auto_class
    try:
        return auto_class.from_pretrained(str(model_dir), dtype=dtype)
    except Exception as err:
        names = ", ".join(p.name for p in preflight.weight_files(model_dir))
        raise ModelSourceError(
            f"cannot load the {what} in {model_dir} ({names}): {type(err).__name__}: {err}"
        ) from err


def quantize_linears(model, dtype: torch.dtype, device: torch.device, embeddings: bool) -> str:
    """NF4-quantise every Linear but the output head (and, ``embeddings``, the input embeddings
    and the head too), on ``device``; returns a memory summary."""
    head = model.get_output_embeddings()
    if device.type == "cuda":
        model.to(device)  # quantise where the weights will live: fast, and no host round trip
    n = nf4.quantize_model_(model, dtype, skip=(head,) if head is not None else ())
    if n == 0:
        raise ValueError(
            f"load_in_4bit=True but {type(model).__name__} has no nn.Linear layers to quantise"
        )
    if embeddings:
        n += nf4_embedding.quantize_embeddings_(model, dtype)
    stacks, expert_bytes, expert_bf16 = nf4_experts.quantize_experts_(model, dtype)
    mem = nf4.memory_report(model)
    kept = "norms" if embeddings else "embeddings, norms and lm_head"
    experts = (
        f"; {stacks} expert stacks: {expert_bytes / 2**20:.1f} MiB vs {expert_bf16 / 2**20:.1f} "
        f"MiB in bf16 (dequantised per expert by the fused expert op)"
        if stacks
        else ""
    )
    return (
        f"4-bit NF4 ({nf4_kernels.dequantizer_name(device)} dequantiser) on {n} weight matrices: "
        f"{mem['quantized'] / 2**20:.1f} MiB vs {mem['linear_bf16'] / 2**20:.1f} MiB in bf16 "
        f"({mem['quantized'] / mem['linear_bf16']:.3f}x){experts}; whole model "
        f"{mem['total'] / 2**20:.1f} MiB = {mem['total'] / mem['model_bf16']:.3f}x of a bf16 copy "
        f"({kept} stay {dtype})"
    )


def int8_linears(model, dtype: torch.dtype, device: torch.device) -> str:
    """int8 weights with int8 products for every Linear but the output head (CPU only);
    returns a summary."""
    if device.type != "cpu":
        raise ValueError(f"load_in_int8 runs int8 products on CPUs; the device is {device}")
    head = model.get_output_embeddings()
    n = int8.quantize_model_(model, dtype, skip=(head,) if head is not None else ())
    if n == 0:
        raise ValueError(f"load_in_int8=True but {type(model).__name__} has no nn.Linear layers")
    return (f"int8 weights and products on {n} linear layers (rows rounded to 8 bits per "
            f"product; embeddings, norms and lm_head stay {dtype})")  # fmt: skip


def load_language_model(
    model_name: str | None = None,
    max_seq_length: int = 2048,
    dtype: torch.dtype | str | None = None,
    load_in_4bit: bool = False,
    device: str | torch.device | None = None,
    quantize_embeddings: bool = False,
    load_in_int8: bool = False,
) -> LoadedModel:
    """What :meth:`FastLanguageModel.from_pretrained` loads (same arguments), as a
    :class:`LoadedModel` (processor None); the decisions are printed to stderr."""
    if quantize_embeddings and not load_in_4bit:
        raise ValueError("quantize_embeddings=True needs load_in_4bit=True")
    if load_in_int8 and load_in_4bit:
        raise ValueError("load_in_int8 and load_in_4bit exclude each other")
    if max_seq_length < 1:
        raise ValueError(f"max_seq_length must be >= 1, got {max_seq_length}")
    t0 = time.perf_counter()
    model_dir = Path(resolve_model_source(model_name))
    device = preflight.choose_device(device)
    dtype, why = preflight.choose_dtype(device, dtype)
    config = preflight.check_config(model_dir)
    tokenizer = preflight.load_tokenizer(model_dir, max_seq_length)
    preflight.check_weights(model_dir)
    model = load_hf_weights(model_dir, dtype)
    quant = quantize_linears(model, dtype, device, quantize_embeddings) if load_in_4bit else None
    if load_in_int8:
        quant = int8_linears(model, dtype, device)
    model.to(device)
    mixers.install(model)  # hybrids: token-mixer state restarts per example (before decoding)
    decoding.install(model)  # decoding's few-row products at the weights' read speed
    moe.install_frozen(model)  # experts: the fused expert op instead of the per-expert loop
    n_params = sum(p.numel() for p in model.parameters()) + sum(
        w.shape.numel() for w in (*nf4.quantized_weights(model), *int8.quantized_weights(model))
    )
    origin = "" if str(model_name) == str(model_dir) else f" from {model_dir}"
    say(
        f"loaded {model_name or 'the built-in ' + DEFAULT_MODEL} ({config.model_type}, "
        f"{n_params / 1e6:.1f}M params){origin} in {time.perf_counter() - t0:.1f} s "
        f"on {device}, dtype {str(dtype).removeprefix('torch.')} ({why})"
    )
    if quant:
        say(quant)
    return LoadedModel(model, tokenizer)


def language_targets(model, target_modules=None, expert_lora: bool = True, lora_dropout=0.0,
                     lora_options: dict | None = None) -> LoraTargets:  # fmt: skip
    """The :class:`LoraTargets` of a causal LM (:func:`lora_targets`; on a mixture-of-experts
    model the expert tensors too, the options checked against them, and the report naming every
    expert part left untrained)."""
    targets, experts = lora_targets(model, target_modules, expert_lora)
    moe_targets.check_options(experts, lora_dropout, lora_options or {})
    return LoraTargets(targets, list(experts.target_parameters),
                       notes=[f"untrained: {u}" for u in experts.untrained])  # fmt: skip


def apply_heap_policy(report) -> heap.HeapPolicy:
    """:func:`lorafuse.heap.apply_training_policy` for a run on CPU (large buffers unless the
    kernels are forced to torch), its lines added to ``report``."""
    policy = heap.apply_training_policy(large_buffers=backends.requested() != "torch")
    report.notes.extend(policy.notes)
    return policy


class FastLanguageModel:
    """The UnSloth-style entry point (static methods only)."""

    @staticmethod
    def from_pretrained(
        model_name: str | None = None,
        max_seq_length: int = 2048,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = False,
        device: str | torch.device | None = None,
        quantize_embeddings: bool = False,
        load_in_int8: bool = False,
    ):
        """``(model, tokenizer)`` from a local HF dir, a .gguf file, a cached hub id, or the default.

        ``dtype=None``: bf16 where native, fp16 on pre-Ampere CUDA, fp32 otherwise.
        ``load_in_4bit``: NF4 base weights for every Linear except the lm_head.
        ``load_in_int8``: int8 base weights whose frozen products run in int8
        (:mod:`lorafuse.models.int8`; CPUs with AMX or AVX-512-VNNI).
        ``quantize_embeddings`` (with ``load_in_4bit``): the input embeddings and the lm_head in
        NF4 too (:mod:`lorafuse.models.nf4_embedding`: less memory on large vocabularies; the
        frozen logits then come from 4-bit weights).
        ``model.max_seq_length`` is set for scripts written for Unsloth (lorafuse reads it nowhere).
        """
        model, tokenizer, _ = load_language_model(
            model_name, max_seq_length, dtype, load_in_4bit, device, quantize_embeddings,
            load_in_int8,
        )  # fmt: skip
        model.max_seq_length = max_seq_length
        return model, tokenizer

    @staticmethod
    def get_peft_model(
        model,
        r: int = 16,
        target_modules: list[str] | str | None = None,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing: bool | str = True,
        use_rslora: bool = False,
        init_lora_weights: bool | str = True,
        modules_to_save: list[str] | None = None,
        random_state: int = 3407,
        cpu_heap_policy: bool = True,
        expert_lora: bool = True,
        **lora_options,
    ):
        """A PEFT LoRA model on ``model``, patched onto lorafuse's fused ops (report printed;
        :func:`lorafuse.models.attach.attach_lora`).

        ``expert_lora`` (mixture-of-experts models): LoRA on the routed experts' fused tensors and
        the routers too (PEFT ``target_parameters``, :mod:`lorafuse.models.moe_targets`), besides
        ``target_modules`` (which reach the shared experts); False leaves them frozen. The
        report names every expert part left untrained.
        ``lora_options`` go to ``peft.LoraConfig`` as given (``rank_pattern``, ``lora_bias``, ...).
        On CPU, ``cpu_heap_policy`` also applies :func:`lorafuse.heap.apply_training_policy`
        (process-wide; its lines join the report; :func:`lorafuse.heap.revert_training_policy`
        undoes it).
        """
        require_base(model)
        device = next(model.parameters()).device
        options = dict(bias=bias, use_rslora=use_rslora, init_lora_weights=init_lora_weights,
                       **lora_options)  # fmt: skip
        targets = language_targets(model, target_modules, expert_lora, lora_dropout, options)
        targets.modules_to_save = modules_to_save
        peft_model, report = attach_lora(
            model, targets, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
            gradient_checkpointing=use_gradient_checkpointing, seed=random_state, **options,
        )  # fmt: skip
        if cpu_heap_policy and device.type == "cpu":
            apply_heap_policy(report)
        announce(peft_model, report)
        return peft_model

    @staticmethod
    def for_inference(model):
        """Eval mode, checkpointing off, KV cache on, the decoding kernels and step
        (:mod:`lorafuse.patching.decoding`). Returns ``model``."""
        grad_checkpointing.disable(model)
        mixers.install(model)
        decoding.install(model)
        model.eval()
        grad_checkpointing.hf_model(model).config.use_cache = True
        return model

    @staticmethod
    def for_training(model):
        """Train mode, checkpointing back as configured, KV cache off. Returns ``model``."""
        model.train()
        mode = grad_checkpointing.mode_of(model)
        if mode:
            grad_checkpointing.enable(model, mode)
        grad_checkpointing.hf_model(model).config.use_cache = False
        return model


def lora_targets(model, target_modules, expert_lora: bool = True):
    """``(target_modules, ExpertPlan)``: :func:`resolve_targets`, and for a mixture-of-experts
    model its expert plan (:func:`lorafuse.models.moe_targets.plan`): the routed experts and
    routers as ``target_parameters``, the shared experts added to the modules, and the names
    PEFT would re-map to the experts kept out (so the adapter config says exactly what is
    trained). The stock baseline (``lorafuse train --no-fused``) builds the same set."""
    experts = moe_targets.plan(model, expert_lora)
    if not experts.has_experts:
        return resolve_targets(model, target_modules), experts
    if target_modules == "all-linear":
        targets = moe_targets.linear_names(model)
    else:
        targets = resolve_targets(model, target_modules)
        if targets == "all-linear":
            targets = moe_targets.linear_names(model)
        if target_modules is None:
            targets = [*targets, *(s for s in experts.shared if s not in targets)]
    if target_modules is None or target_modules == "all-linear":
        targets = [t for t in targets if t not in experts.remapped]
    return targets, experts


def resolve_targets(model, target_modules) -> list[str] | str:
    """Explicit module names (so adapter_config.json lists them) or ``"all-linear"``."""
    if target_modules == "all-linear":
        return "all-linear"
    if isinstance(target_modules, str):
        return [target_modules]
    linear = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    if target_modules is None:
        found = [t for t in LLAMA_PROJECTIONS if t in linear]
        if not found:
            say(
                f"none of {LLAMA_PROJECTIONS} in {type(model).__name__}: targeting all linear layers"
            )
            return "all-linear"
        return found
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in target_modules if t not in names]
    if missing:
        raise ValueError(
            f"target_modules {missing} not found in the model; its linear layers are {sorted(linear)}"
        )
    return list(target_modules)
