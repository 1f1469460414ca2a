"""Per-architecture fast paths: :func:`apply_fast_paths` looks ``config.model_type`` up in the
registry (:mod:`lorafuse.patching.registry`: llama, mistral, qwen2, qwen3, smollm3 in full; phi3,
gemma2, gemma3_text, the VLM decoders and the late-2026 families in part) and binds the fused
forwards of :mod:`lorafuse.patching.fused_forwards` (norm, MLP, loss) and
:mod:`lorafuse.patching.attention` to every *instance* of the architecture's RMSNorm, Attention,
MLP and ForCausalLM classes (matched exactly); the report names each fast path applied and says
why the rest stays stock. Modules inside a token mixer or an expert block the spec names
(``mixers``) are left to that block's own patcher, and the report names every such block still
running transformers' code.

With ``labels`` under autograd the fused loss returns ``logits=None`` (never materialised); see
:mod:`lorafuse.patching.fused_forwards`.

Any other architecture still gets the generic LoRA Linear patch from :mod:`.peft_lora`; the report
says so.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from lorafuse.ops.attention import AUTO_MAX_LENGTH
from lorafuse.ops.attention import default_kernel as default_attention_kernel
from lorafuse.patching import peft_lora
from lorafuse.patching.attention import attention_forward
from lorafuse.patching.fused_forwards import (
    causal_lm_forward,
    fp32_norm_forward,
    gate_up_mlp_forward,
    geglu_mlp_forward,
    loss_blocker,
    mlp_forward,
    offset_norm_forward,
    rms_norm_forward,
)
from lorafuse.patching.registry import GENERIC_NOTE, REGISTRY
from lorafuse.patching.report import PatchReport

# --------------------------------------------------------------------------------------------
# Applying the registry.

_NORMS = {  # spec.norm -> (forward, fast-path name suffix)
    "llama": (rms_norm_forward, ""),
    "offset": (offset_norm_forward, "[1+w, fp32, rounded once]"),
    "fp32": (fp32_norm_forward, "[fp32 w, rounded once]"),
}
_ACTIVATIONS = {"silu": "", "gelu_pytorch_tanh": " gelu_tanh"}  # what lora_mlp computes


def _patch_instances(model, cls, fn, backend, report, name, spec=None, skip=frozenset()) -> None:
    if cls is None:
        return
    n = 0
    for module in model.modules():
        if type(module) is cls and id(module) not in skip:
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
    inside = _inside_mixers(model, spec)
    if "rms_norm" in spec.parts:
        fn, suffix = _NORMS[spec.norm]
        cls = spec.cls("RMSNorm")
        _patch_instances(model, cls, fn, backend, report, f"{p}.rms_norm{suffix}", skip=inside)
    if "mlp" in spec.parts:
        _apply_mlp(model, spec, config, backend, report, inside)
    if "attention" in spec.parts:
        name = f"{p}.attention[{_attention_parts(spec, config)}]"
        _patch_instances(model, spec.cls("Attention"), attention_forward, backend, report, name,
                         spec)  # fmt: skip
        _note_attention(model, backend, report)
    if "loss" in spec.parts:
        _apply_loss(model, spec, backend, report)
    _note_mixers(model, spec, report)


def _apply_mlp(model, spec, config, backend, report, inside) -> None:
    p = spec.prefix.lower()
    act = spec.activation or getattr(config, spec.act_attr, None)
    if act not in _ACTIVATIONS:
        report.notes.append(
            f"{p} mlp stays stock: {spec.act_attr} is {act!r} (lora_mlp computes silu (SwiGLU) "
            "and gelu_pytorch_tanh (GeGLU))"
        )
        return
    if act == "silu":
        fn = gate_up_mlp_forward if spec.gate_up else mlp_forward
    else:
        fn = geglu_mlp_forward
    halves = f" on {spec.mlp_names[0]} halves" if spec.gate_up else ""
    name = f"{p}.mlp[lora_mlp{_ACTIVATIONS[act]}{halves}]"
    _patch_instances(model, spec.cls("MLP"), fn, backend, report, name, spec, inside)


def _attention_parts(spec, config) -> str:
    parts = ["lora_qkv", "rope", "causal_attention"]
    if getattr(config, "position_embedding_type", "rope") is None:  # Granite 4 without rope
        parts.remove("rope")
    if spec.q_gate:
        parts.insert(1, "output_gate")
    if spec.sinks:
        parts[-1] = "sinks_in_model_interface"
    return "+".join(parts)


def _inside_mixers(model, spec) -> frozenset[int]:
    """ids of the modules inside the spec's token mixers and expert blocks (their patcher's)."""
    classes = {spec.cls(name) for name, _ in spec.mixers} - {None}
    out = set()
    for module in model.modules():
        if type(module) in classes:
            out.update(id(m) for m in module.modules() if m is not module)
    return frozenset(out)


def _note_mixers(model, spec, report) -> None:
    """One note per token-mixer / expert-block class still on transformers' own forward (a block
    whose experts :mod:`lorafuse.patching.moe` fused is not: the patch sits on a child)."""
    what = dict(spec.mixers)
    stock = Counter(
        type(m).__name__
        for m in model.modules()
        if type(m).__name__ in what and not any(peft_lora.is_installed(c) for c in m.modules())
    )
    for name, n in stock.items():
        report.notes.append(
            f"{n} x {name} ({what[name]}): transformers' own forward, no lorafuse kernel (its "
            "LoRA Linear layers are fused)"
        )


def _note_attention(model, backend, report) -> None:
    device = next(model.parameters()).device
    attn = default_attention_kernel(device, backend)
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
