"""``--method rm``: TRL's ``RewardTrainer`` on a stock PEFT sequence classifier vs lorafuse's
reward-model objective on the patched causal LM.

Same random pairs as ``--method dpo`` (:func:`~lorafuse.bench.preference.preference_pairs`:
``--batch`` pairs of ``--seq`` tokens, the first half shared), so a step runs 2B rows of ``seq``
tokens once (no reference model) on both sides:

* stock: ``AutoModelForSequenceClassification`` (``num_labels=1``) with PEFT LoRA
  (``task_type=SEQ_CLS``: the ``score`` head trained in full), batches built by TRL's own
  collator (``trainer.data_collator``), loss from ``RewardTrainer.compute_loss``;
* lorafuse: the causal LM patched by ``patch_peft_model`` with the fp32 ``score`` head of
  :func:`lorafuse.train.reward.attach_score_head` (as ``lorafuse train --method rm``), loss from
  :class:`~lorafuse.train.reward.RewardObjective`.

Both decoders come from the same seed (identical weights), both heads get the same weights
(:func:`head_weight`) and the pad id is 0, which no pair token takes, so every sequence is scored
at its last token: in fp32 the first losses agree, and each step records what it trained on
(:func:`~lorafuse.bench.model.batch_record`). By design the stock head runs in the model's dtype
(transformers' classifier) and projects every position; ours is fp32 and reads the last one.
"""

from __future__ import annotations

import tempfile

from lorafuse.bench.config import TARGETS, model_config
from lorafuse.bench.model import batch_record, build_model, finish_step

PAD_ID = 0  # <unk> of the word tokenizer; preference_pairs draws ids from 1 on


def head_weight(spec: dict):
    """(1, H) fp32 score-head weight both sides start from: normal with the config's
    ``initializer_range`` (transformers' init of the head), from its own seed."""
    import torch

    config = model_config(spec["model"])
    g = torch.Generator().manual_seed(1)
    std = getattr(config, "initializer_range", 0.02)
    return torch.randn(1, config.hidden_size, generator=g) * std


def _trl_reward(spec: dict, base):
    """A TRL RewardTrainer around the sequence classifier ``base`` (LoRA + the score head)."""
    import peft
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from lorafuse.data.word_tokenizer import word_tokenizer

    args = RewardConfig(output_dir=tempfile.mkdtemp(prefix="lorafuse-bench-rm-"), report_to=[],
                        use_cpu=spec["device"] == "cpu", bf16=False, fp16=False, pad_token="<unk>",
                        gradient_checkpointing=bool(spec["grad_ckpt"]))  # fmt: skip
    lora = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["rank"], target_modules=TARGETS,
                           task_type="SEQ_CLS")  # fmt: skip
    data = Dataset.from_list([{"chosen": "a b", "rejected": "a c"}])
    trainer = RewardTrainer(model=base, args=args, train_dataset=data,
                            processing_class=word_tokenizer(), peft_config=lora)  # fmt: skip
    if trainer.model.config.pad_token_id != PAD_ID:
        raise RuntimeError(f"TRL's pad id is {trainer.model.config.pad_token_id}, not {PAD_ID}")
    return trainer


def _stock_classifier(spec: dict, device):
    """The bench model's decoder (same seed as :func:`build_model`) under a 1-label head."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from lorafuse.dtypes import parse_dtype

    config = model_config(spec["model"])
    config.num_labels, config.pad_token_id = 1, PAD_ID
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.copy_(head_weight(spec))
    return model.to(dtype=parse_dtype(spec["dtype"]), device=device)


def reward_setup(spec: dict):
    """``(model, step(model, opt, pairs) -> loss)`` for ``spec['config']`` under --method rm;
    the step's ``seen`` lists each batch it trained on."""
    import torch

    from lorafuse.train.preference import collate_pairs
    from lorafuse.train.reward import RewardObjective, attach_score_head, score_head

    device = torch.device(spec["device"])
    seen: list[dict] = []
    if spec["config"] == "stock":
        trainer = _trl_reward(spec, _stock_classifier(spec, device))

        def trl_step(model, opt, pairs):
            rows = [{"chosen_ids": p.chosen.input_ids, "rejected_ids": p.rejected.input_ids}
                    for p in pairs]  # fmt: skip
            batch = {k: v.to(device) for k, v in trainer.data_collator(rows).items()}
            seen.append(batch_record(batch["input_ids"], batch.get("attention_mask")))
            return finish_step(trainer.compute_loss(model, batch), opt)

        trl_step.seen = seen
        return trainer.model, trl_step
    model = build_model(spec)
    attach_score_head(model)
    with torch.no_grad():
        score_head(model).modules_to_save.default.weight.copy_(head_weight(spec))
    objective = RewardObjective(None, PAD_ID, device)

    def our_step(model, opt, pairs):
        batch = collate_pairs(pairs, PAD_ID, device)  # what the objective collates
        seen.append(batch_record(batch["input_ids"], batch.get("attention_mask")))
        loss, _ = objective.loss(model, pairs, objective.counts(pairs))
        return finish_step(loss, opt)

    our_step.seen = seen
    return model, our_step
