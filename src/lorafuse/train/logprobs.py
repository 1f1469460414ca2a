"""Summed log-probs of target tokens, without the logits: the helpers every objective that scores
sequences shares (DPO / ORPO, KTO, GRPO).

A forward hook takes the decoder's final hidden states (rows, T, H) and
:func:`lorafuse.ops.token_logprobs.token_logprobs` scores them chunk by chunk against the frozen
``lm_head`` weight; the model itself is called with ``logits_to_keep`` = an empty index, so its
own head projects no position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.ops.token_logprobs import token_logprobs
from lorafuse.train import distributed as dist
from lorafuse.train.objective import ObjectiveError


def peft_model(model):
    """The PEFT model inside a DDP / FSDP wrapper (the model itself when unwrapped)."""
    return dist.unwrap_model(model)


def head_and_decoder(model):
    """``(lm_head, decoder)`` of a PEFT causal LM; the head must be a frozen plain Linear."""
    inner = peft_model(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    head = base.get_output_embeddings()
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    if type(head) is not torch.nn.Linear or decoder is None:
        raise ObjectiveError(
            f"log-prob objectives need a plain frozen nn.Linear lm_head and a decoder module; "
            f"this model has lm_head {type(head).__name__} (LoRA or modules_to_save on lm_head "
            "is not supported)"
        )
    if head.weight.requires_grad:
        raise ObjectiveError("log-prob objectives keep lm_head frozen; it requires grad here")
    return head, decoder


def final_hidden(model, input_ids, attention_mask=None):
    """``(hidden (rows, T, H), lm_head)``: the decoder's final hidden states of a forward of
    ``model`` (PEFT model, possibly DDP-wrapped) whose own head projects no position."""
    head, decoder = head_and_decoder(model)
    caught = {}

    def hook(module, args, output):
        caught["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = decoder.register_forward_hook(hook)
    try:
        no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
              logits_to_keep=no_logits)  # fmt: skip
    finally:
        handle.remove()
    return caught["hidden"], head


def sequence_logps(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed log-probs of each row's target tokens (labels != -100, causal shift), (rows,) fp32.

    Runs ``model`` on the batch without its head (:func:`final_hidden`); the hidden states
    (rows, T, H) are scored by :func:`token_logprobs`.
    """
    hidden, head = final_hidden(model, batch["input_ids"], batch.get("attention_mask"))
    shift = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]  # (rows, T)
    return token_logprobs(hidden, head.weight, shift.to(hidden.device), bias=head.bias)
