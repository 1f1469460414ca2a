"""``--method distill``: TRL's ``DistillationTrainer`` loss on stock PEFT vs lorafuse's distill
objective on the patched model. Same random rows: ``--batch`` rows of ``--seq`` tokens, the second
half the completion; the teacher is a second random model of the same configuration (seed 1,
frozen, plain transformers on both sides), so both sides hold two models. A step is the teacher's
forward (no gradient), the student's forward, the divergence over the completion tokens (TRL:
its chunked-tile kernel; lorafuse: :func:`lorafuse.ops.divergence.divergence`), backward and
AdamW; beta 0.5 (the generalized JSD, the most work), temperature 1. No generation: the on-policy
part of a step is the GRPO bench's (``--method grpo``)."""

from __future__ import annotations

import tempfile

from lorafuse.bench.config import TARGETS, model_config
from lorafuse.bench.model import build_model, finish_step

BETA = 0.5


def distill_rows(spec: dict, n: int) -> list:
    """``n`` steps of ``spec['batch']`` random rows (lorafuse ``Row``s, completion = 2nd half)."""
    import torch

    from lorafuse.data.masking import IGNORE_INDEX
    from lorafuse.data.packing import Row

    g = torch.Generator().manual_seed(1234)
    vocab, seq = model_config(spec["model"]).vocab_size, spec["seq"]
    half = seq // 2
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (spec["batch"], seq), generator=g).tolist()
        out.append([Row(r, [IGNORE_INDEX] * half + r[half:], list(range(seq)), 1) for r in ids])
    return out


def _teacher(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    from lorafuse.dtypes import parse_dtype

    torch.manual_seed(1)
    teacher = AutoModelForCausalLM.from_config(model_config(spec["model"]))
    teacher = teacher.to(dtype=parse_dtype(spec["dtype"]), device=spec["device"]).eval()
    return teacher.requires_grad_(False)


def _trl_distill(spec: dict, base, teacher):
    import peft
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from lorafuse.data.word_tokenizer import word_tokenizer

    args = DistillationConfig(output_dir=tempfile.mkdtemp(prefix="lorafuse-bench-distill-"),
                              report_to=[], use_cpu=spec["device"] == "cpu", bf16=False,
                              fp16=False, gradient_checkpointing=bool(spec["grad_ckpt"]),
                              beta=BETA, temperature=1.0)  # fmt: skip
    lora = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["rank"], target_modules=TARGETS)
    tok = word_tokenizer()
    tok.pad_token = tok.eos_token
    return DistillationTrainer(model=base, teacher_model=teacher, args=args,
                               train_dataset=Dataset.from_list([{"prompt": "a"}]),
                               processing_class=tok, peft_config=lora)  # fmt: skip


def distill_setup(spec: dict):
    """``(model, step(model, opt, rows) -> loss)`` for ``spec['config']`` under --method distill."""
    import torch

    from lorafuse.train.distill import DistillObjective

    device = torch.device(spec["device"])
    teacher = _teacher(spec)
    if spec["config"] == "stock":
        from transformers import AutoModelForCausalLM

        from lorafuse.dtypes import parse_dtype

        torch.manual_seed(0)  # the same base weights as build_model's
        base = AutoModelForCausalLM.from_config(model_config(spec["model"]))
        base = base.to(dtype=parse_dtype(spec["dtype"]), device=device)
        trainer = _trl_distill(spec, base, teacher)
        half = spec["seq"] // 2

        def trl_step(model, opt, rows):
            ids = torch.tensor([r.input_ids for r in rows], device=device)  # (B, seq)
            prompt, completion = ids[:, :half], ids[:, half:]
            batch = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt),
                     "completion_ids": completion,
                     "completion_mask": torch.ones_like(completion)}  # fmt: skip
            n = batch["completion_mask"].sum()
            loss, _, _ = trainer._compute_loss(model, batch, n)
            return finish_step(loss, opt)

        return trainer.model, trl_step
    model = build_model(spec)
    objective = DistillObjective(BETA, 1.0, None, 0, None, device)
    objective.teacher = teacher  # what check() loads from --teacher DIR

    def our_step(model, opt, rows):
        loss, _ = objective.loss(model, rows, objective.counts(rows))
        return finish_step(loss, opt)

    return model, our_step
