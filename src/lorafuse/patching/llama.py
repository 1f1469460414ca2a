"""Per-architecture fast paths: :func:`apply_fast_paths` looks ``config.model_type`` up in the
registry (:mod:`lorafuse.patching.registry`: llama, mistral, qwen2, qwen3, smollm3 in full; phi3,
gemma2, gemma3_text and the VLM decoders in part) and binds the fused forwards of
:mod:`lorafuse.patching.llama_forwards` to every *instance* of the architecture's RMSNorm,
Attention, MLP and ForCausalLM classes (matched exactly); the report names each fast path applied
and says why the rest stays stock.

With ``labels`` under autograd the fused loss returns ``logits=None`` (never materialised); see
:mod:`lorafuse.patching.llama_forwards`.

Any other architecture still gets the generic LoRA Linear patch from :mod:`.peft_lora`; the report
says so.
"""

from __future__ import annotations

import torch
from torch import nn

from lorafuse import backends
from lorafuse.ops.attention import AUTO_MAX_LENGTH
from lorafuse.patching import peft_lora
from lorafuse.patching.llama_forwards import (
    attention_forward,
    attention_request,
    causal_lm_forward,
    gate_up_mlp_forward,
    geglu_mlp_forward,
    gemma_norm_forward,
    loss_blocker,
    mlp_forward,
    rms_norm_forward,
)
from lorafuse.patching.registry import GENERIC_NOTE, REGISTRY
from lorafuse.patching.report import PatchReport

# --------------------------------------------------------------------------------------------
# Applying the registry.


def _patch_instances(model, cls, fn, backend, report, name, spec=None) -> None:
    if cls is None:
        return
    n = 0
    for module in model.modules():
        if type(module) is cls:
            if spec is not None:
                module._lorafuse_spec = spec
            peft_lora.install_forward(module, fn, backend)
            n += 1
    if n:
        report.add_fast_path(name, n)


def apply_fast_paths(model: nn.Module, backend: str | None, report: PatchReport) -> None:
    """Apply the registry's fast paths to every matching module of ``model``; record them."""
    config = getattr(model, "config", None)
    arch = getattr(config, "model_type", None)
    report.architecture = arch
    spec = REGISTRY.get(arch)
    if spec is None:
        known = ", ".join(REGISTRY)
        report.notes.append(GENERIC_NOTE.format(arch=arch, known=known))
        return
    p = spec.prefix.lower()
    report.notes += spec.stock + spec.notes
    config = getattr(config, "text_config", config)  # a VLM's decoder settings
    if "rms_norm" in spec.parts and spec.norm_offset:
        _apply_gemma_norm(model, spec, backend, report)
    elif "rms_norm" in spec.parts:
        _patch_instances(
            model, spec.cls("RMSNorm"), rms_norm_forward, backend, report, f"{p}.rms_norm"
        )
    if "mlp" in spec.parts and spec.norm_offset:  # Gemma
        if getattr(config, "hidden_activation", None) == "gelu_pytorch_tanh":
            name = f"{p}.mlp[lora_mlp gelu_tanh]"
            _patch_instances(model, spec.cls("MLP"), geglu_mlp_forward, backend, report, name)
        else:
            report.notes.append(f"{p} mlp stays stock: hidden_activation is not gelu_pytorch_tanh")
    elif "mlp" in spec.parts:
        if getattr(config, "hidden_act", None) == "silu":
            fn = gate_up_mlp_forward if spec.gate_up else mlp_forward
            name = f"{p}.mlp[lora_mlp{' on gate_up_proj halves' if spec.gate_up else ''}]"
            _patch_instances(model, spec.cls("MLP"), fn, backend, report, name)
        else:
            report.notes.append(f"{p} mlp stays stock: hidden_act is not silu (lora_mlp is SwiGLU)")
    if "attention" in spec.parts:
        _patch_instances(
            model,
            spec.cls("Attention"),
            attention_forward,
            backend,
            report,
            f"{p}.attention[lora_qkv+rope+causal_attention]",
            spec,
        )
        _note_attention(model, backend, report)
    if "loss" in spec.parts:
        _apply_loss(model, spec, backend, report)


def _apply_gemma_norm(model, spec, backend, report) -> None:
    """The fused (1 + w) norm on Gemma's fp32 norms (the q/k norms included); others stay stock."""
    cls, p = spec.cls("RMSNorm"), spec.prefix.lower()
    norms = [m for m in model.modules() if type(m) is cls]
    fp32 = [m for m in norms if m.weight.dtype == torch.float32]
    for m in fp32:
        peft_lora.install_forward(m, gemma_norm_forward, backend)
    if fp32:
        report.add_fast_path(f"{p}.rms_norm[1+w]", len(fp32))
    low = sorted({str(m.weight.dtype) for m in norms if m.weight.dtype != torch.float32})
    if low:
        report.notes.append(
            f"{p} rms_norm stays stock on {', '.join(low)} weights: Gemma multiplies by (1 + w) "
            "in fp32 and rounds once; the fused norm rounds the normalised value first"
        )


def _note_attention(model, backend, report) -> None:
    device = next(model.parameters()).device
    attn = backends.select("attention", device, attention_request(backend))
    report.notes.append(
        f"causal attention: {attn} kernel for unpadded causal batches under sdpa, up to "
        f"{AUTO_MAX_LENGTH['native bf16 (brgemm)']} tokens with bf16 through oneDNN's brgemm, "
        f"{AUTO_MAX_LENGTH['native low precision']} with other native low-precision products and "
        f"{AUTO_MAX_LENGTH['fp32']} with fp32 under auto (longer: the model's own interface)"
        if attn != "torch"
        else "causal attention: the model's own attention interface (no faster kernel here)"
    )


def _apply_loss(model, spec, backend, report) -> None:
    cls = spec.cls("ForCausalLM")
    if cls is None:
        return
    for module in model.modules():
        if type(module) is not cls:
            continue
        why = loss_blocker(module)
        if why is not None:
            report.notes.append(f"fused cross-entropy not applied: {why}")
            continue
        peft_lora.install_forward(module, causal_lm_forward, backend)
        report.add_fast_path(f"{spec.prefix.lower()}.causal_lm_loss[fused_linear_cross_entropy]")
        report.notes.append(
            "with labels under autograd the fused loss returns logits=None (never materialised)"
        )
