"""Knowledge distillation (``distill``) on the fused engine, as TRL's ``DistillationTrainer``
computes its loss.

The student is the LoRA-adapted model; the teacher is another local model with the same vocabulary
(``--teacher DIR``, loaded frozen in the student's dtype on its device) or the base itself (the
adapter disabled: no second copy of the weights). Per micro-batch of right-padded rows (prompt +
completion, labels -100 outside the completion), both models run without their heads
(:func:`lorafuse.train.logprobs.final_hidden`); the positions that predict a completion token are
kept and :func:`lorafuse.ops.divergence.divergence` compares the two next-token distributions
chunk by chunk (``beta``: 0 forward KL, 1 reverse KL, between the generalized JSD; both at
``temperature``). The loss is the per-token divergence summed over the micro-batch and divided by
the global number of completion tokens (TRL's ``num_items_in_batch``): accumulated micro-batches
give the big batch's gradient. Logged as TRL does: ``entropy`` (the student's, per token).

Not supported (refused with a message): logit scales and final-logit soft-capping (Gemma 2/3,
Cohere, Granite...), whose head is not a plain product.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.data.packing import collate
from lorafuse.ops.divergence import divergence
from lorafuse.train.logprobs import final_hidden, head_and_decoder, peft_model
from lorafuse.train.objective import Objective, ObjectiveError

# config fields that make a model's logits more than hidden·Wᵀ + b (read by TRL too)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier",
                    "lm_head_multiplier", "logits_scaling")  # fmt: skip


class DistillError(ObjectiveError):
    """The student or teacher cannot be distilled (the message says why)."""


def _plain_logits(model, who: str) -> None:
    config = model.config.get_text_config()
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise DistillError(f"distill: the {who}'s logits use {name}={getattr(config, name)}; "
                               "only plain lm_head logits are supported")  # fmt: skip


def load_teacher(path: str, tokenizer, dtype: torch.dtype, device):
    """The frozen teacher causal LM at ``path`` (eval mode, ``dtype``, on ``device``); its
    vocabulary must be the student tokenizer's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise DistillError(f"teacher={path!r}: not a local model dir (no config.json)")
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    teacher.requires_grad_(False)
    if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        vocab = AutoTokenizer.from_pretrained(path).get_vocab()
        mine = tokenizer.get_vocab()
        if vocab != mine:
            diff = sorted(set(vocab.items()) ^ set(mine.items()), key=lambda kv: kv[1])[:3]
            raise DistillError(f"teacher={path!r}: its tokenizer differs from the student's "
                               f"({len(vocab)} vs {len(mine)} tokens; e.g. {diff}); distillation "
                               "compares next-token distributions over one vocabulary")  # fmt: skip
    _plain_logits(teacher, "teacher")
    return teacher


class DistillObjective(Objective):
    """Distillation for the engine: normalisers, per-micro-batch loss, metrics."""

    def __init__(self, beta: float, temperature: float, teacher: str | None, pad_id: int,
                 tokenizer, device) -> None:  # fmt: skip
        self.beta, self.temperature, self.teacher_path = beta, temperature, teacher
        self.pad_id, self.tokenizer, self.device = pad_id, tokenizer, device
        self.teacher = None  # the loaded teacher model (None: the base, adapter disabled)

    @classmethod
    def from_config(cls, cfg, tokenizer, device) -> DistillObjective:
        return cls(cfg.beta, cfg.temperature, cfg.teacher, tokenizer.pad_token_id, tokenizer,
                   device)  # fmt: skip

    def check(self, model) -> None:
        head, _ = head_and_decoder(model)
        _plain_logits(peft_model(model), "student")
        if self.teacher_path is None:
            if not hasattr(peft_model(model), "disable_adapter"):
                raise DistillError("distill without --teacher needs a PEFT model: the teacher is "
                                   "the base with the adapter disabled")  # fmt: skip
            return
        self.teacher = load_teacher(self.teacher_path, self.tokenizer, head.weight.dtype,
                                    head.weight.device)  # fmt: skip
        t_head, _ = head_and_decoder(self.teacher)
        if t_head.weight.shape[0] != head.weight.shape[0]:
            raise DistillError(f"teacher={self.teacher_path!r}: lm_head of {t_head.weight.shape[0]} "
                               f"rows, the student's has {head.weight.shape[0]}")  # fmt: skip

    def tokens(self, row) -> int:
        return len(row.input_ids)

    def counts(self, rows) -> torch.Tensor:
        """This rank's ``[completion tokens]`` (the engine sums them over ranks)."""
        return torch.tensor([float(sum(r.n_targets for r in rows))], device=self.device)

    @torch.no_grad()
    def teacher_hidden(self, model, input_ids, attention_mask):
        """``(hidden (rows, T, Ht), lm_head)`` of the teacher, in eval mode, without gradient."""
        if self.teacher is not None:
            return final_hidden(self.teacher, input_ids, attention_mask)
        inner = peft_model(model)
        was = inner.training
        inner.eval()  # as TRL's teacher: no dropout
        try:
            with inner.disable_adapter():
                return final_hidden(model, input_ids, attention_mask)
        finally:
            inner.train(was)

    def loss(self, model, rows, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, metric sums)`` of one micro-batch under the global ``counts``."""
        batch = {k: v.to(self.device) for k, v in collate(rows, self.pad_id, False).items()}
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        self.batch_shape = tuple(ids.shape)
        shift = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]  # (rows, T)
        keep = (shift != IGNORE_INDEX).reshape(-1).nonzero().squeeze(1)  # completion positions
        t_hidden, t_head = self.teacher_hidden(model, ids, mask)
        hidden, head = final_hidden(model, ids, mask)
        hs = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)  # (n, Hs)
        ht = t_hidden.reshape(-1, t_hidden.shape[-1]).index_select(0, keep)  # (n, Ht)
        div, entropy = divergence(hs, head.weight, ht, t_head.weight, self.beta,
                                  self.temperature, head.bias, t_head.bias)  # fmt: skip
        return div.sum() / counts[0], entropy.sum().reshape(1)

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Global sums -> the student's mean entropy per completion token (nats)."""
        return {"entropy": float(sums[0]) / max(float(counts[0]), 1.0)}
