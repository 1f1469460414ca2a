"""The bench's model and the end of its step: a stock-PEFT LoRA model of the configuration
(patched by lorafuse for lorafuse's configurations), and backward + optimizer step. Every workload
(LLM, preference, GRPO, vision) builds on these."""

from __future__ import annotations

from lorafuse.bench.config import (
    DIRECT_DTYPE_MODELS,
    MOE_MODELS,
    NF4_EMB,
    QUANTIZED,
    TARGETS,
    model_config,
    targets,
)


def build_model(spec: dict):
    import peft
    import torch

    from lorafuse.dtypes import parse_dtype

    dtype = parse_dtype(spec["dtype"])
    torch.manual_seed(0)
    if spec["model"] in DIRECT_DTYPE_MODELS:
        model = _new_model_in(spec, dtype).to(spec["device"])
    else:
        model = _new_model(spec).to(dtype=dtype, device=spec["device"])
    lora_targets, params = targets(spec["model"]), None
    if spec["model"] in MOE_MODELS:  # the experts and routers too, as lorafuse train's default
        from lorafuse.models.fast_model import lora_targets as moe_lora_targets

        lora_targets, experts = moe_lora_targets(model, TARGETS[:4])
        params = experts.target_parameters
    if spec["config"] in QUANTIZED:
        from lorafuse.models import nf4, nf4_embedding, nf4_experts

        nf4.quantize_model_(model, dtype, skip=(model.get_output_embeddings(),))
        nf4_experts.quantize_experts_(model, dtype)
        if spec["config"] == NF4_EMB:
            nf4_embedding.quantize_embeddings_(model, dtype)
    if spec["grad_ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["rank"], target_modules=lora_targets,
                          target_parameters=params, use_dora=spec.get("use_dora", False))  # fmt: skip
    if spec["config"] in QUANTIZED and cfg.use_dora:  # QDoRA: PEFT's init reads NF4 weights
        from lorafuse.models.nf4 import peft_dora_init

        with peft_dora_init():
            model = peft.get_peft_model(model, cfg)
    else:
        model = peft.get_peft_model(model, cfg)
    if spec["config"].removesuffix("+compile") in ("lorafuse", *QUANTIZED):
        from lorafuse import heap, patch_peft_model

        patch_peft_model(model, backend=spec["backend"])
        if model.device.type == "cpu":  # as `lorafuse train` runs it
            heap.apply_training_policy(large_buffers=spec["backend"] != "torch")
    model.train()
    if spec["config"].endswith("+compile"):
        model.compile()  # in place, as `lorafuse train --compile`
    return model


def _new_model(spec: dict):
    """The causal LM of ``spec['model']`` (``spec.get('layers')`` of them: family models only)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_config(spec["model"], spec.get("layers")))


def _new_model_in(spec: dict, dtype):
    """The causal LM of ``spec['model']`` (``spec.get('layers')`` of them) created in ``dtype``
    (its init draws in that dtype; no fp32 copy of a large model first)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return _new_model(spec)
    finally:
        torch.set_default_dtype(previous)


def batch_record(input_ids, attention_mask=None) -> dict:
    """What one step trained on, for checking both sides saw the same batch: its ``tokens`` (the
    mask's ones, or every id) and a ``digest`` of its token ids (rows in order)."""
    import hashlib

    tokens = input_ids.numel() if attention_mask is None else int(attention_mask.sum())
    ids = input_ids.detach().to("cpu").long().contiguous().numpy()  # (rows, T)
    return {"tokens": tokens, "rows": ids.shape[0],
            "digest": hashlib.sha1(ids.tobytes() + str(ids.shape).encode()).hexdigest()[:16]}  # fmt: skip


def finish_step(loss, opt) -> float:
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())
