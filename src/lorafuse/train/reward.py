"""Reward models (``rm``) on the fused engine, as TRL's ``RewardTrainer`` computes them.

A scalar head ``score: Linear(H, 1, bias=False)`` (transformers' ``*ForSequenceClassification``
head, ``num_labels=1``) reads the decoder's final hidden state at each sequence's last token (the
rightmost token that is not ``pad_token_id``, transformers' rule), so the reward of a sequence is
``r = score(h_last)``. The head is trained in full next to the LoRA adapters: it is PEFT's
``modules_to_save`` entry ``score`` and the adapter is saved with ``task_type=SEQ_CLS``, so
``AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)`` +
``PeftModel.from_pretrained(that, adapter)`` gives the same scores. The head is kept in fp32 (its
input is cast up), the causal LM's own ``lm_head`` projects no position.

Loss per pair (Bradley-Terry, TRL's optional margin and centering term):
``-log σ(r_w - r_l - m) + c · (r_w + r_l)²``, summed over the pairs of a micro-batch and divided by
the global number of pairs: with one micro-batch it is TRL's
``-logsigmoid(r_w - r_l - m).mean() + c · mean((r_w + r_l)²)``; accumulated micro-batches give the
big batch's gradient. Logged as TRL does: ``accuracy`` (r_w > r_l), ``margin`` (mean r_w - r_l),
``mean_reward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafuse.train.logprobs import final_hidden, head_and_decoder, peft_model
from lorafuse.train.objective import Objective, ObjectiveError
from lorafuse.train.preference import collate_pairs as collate_pair_rows

HEAD = "score"  # transformers' sequence-classification head name (Llama, Qwen2, Mistral, ...)
SUMS = ("accuracy", "margin", "mean_reward")


class RewardModelError(ObjectiveError):
    """The model cannot be trained as a reward model (the message says why)."""


def reward_loss(chosen, rejected, margin=None, center_rewards_coefficient: float | None = None):
    """Per-pair loss (B,) from the rewards (B,) of the chosen and rejected sequences."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    losses = -F.logsigmoid(diff)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def last_token_index(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(rows,) index of each row's rightmost non-pad token, as transformers'
    ``*ForSequenceClassification`` picks it (0 for a row of pads)."""
    non_pad = (input_ids != pad_id).int()  # (rows, T)
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device, dtype=torch.int32)
    return (positions * non_pad).argmax(-1)


def score_head(model):
    """The trained ``score`` module of a PEFT model (PEFT's modules_to_save wrapper)."""
    base = peft_model(model).get_base_model()
    head = getattr(base, HEAD, None)
    if head is None:
        raise RewardModelError("rm: the model has no score head (attach_score_head first)")
    return head


def attach_score_head(model) -> None:
    """Give the PEFT ``model`` a trainable fp32 ``score`` head (normal init with the model's
    ``initializer_range``, as transformers), saved with the adapter (modules_to_save, SEQ_CLS)."""
    from peft.utils.other import set_additional_trainable_modules

    peft = peft_model(model)
    base = peft.get_base_model()
    if hasattr(base, HEAD):
        raise RewardModelError(f"rm: the model already has a module named {HEAD!r}")
    text = base.config.get_text_config()
    device = base.get_input_embeddings().weight.device
    head = torch.nn.Linear(text.hidden_size, 1, bias=False, device=device, dtype=torch.float32)
    torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
    base.add_module(HEAD, head)
    config = peft.peft_config[peft.active_adapter]
    config.modules_to_save = list(config.modules_to_save or []) + [HEAD]
    config.task_type = "SEQ_CLS"  # the saved adapter loads on *ForSequenceClassification
    set_additional_trainable_modules(peft, config, base.config, peft.active_adapter)


def sequence_rewards(model, batch: dict[str, torch.Tensor], pad_id: int) -> torch.Tensor:
    """(rows,) fp32 rewards of a right-padded batch: the score of each row's last token."""
    hidden, _ = final_hidden(model, batch["input_ids"], batch.get("attention_mask"))
    idx = last_token_index(batch["input_ids"], pad_id)  # (rows,)
    last = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]  # (rows, H)
    return score_head(model)(last.float()).squeeze(-1)


class RewardObjective(Objective):
    """Bradley-Terry reward modelling for the engine: normalisers, per-micro-batch loss, metrics."""

    def __init__(self, center_rewards_coefficient: float | None, pad_id: int, device) -> None:
        self.center, self.pad_id, self.device = center_rewards_coefficient, pad_id, device

    @classmethod
    def from_config(cls, cfg, pad_id: int, device) -> RewardObjective:
        return cls(cfg.center_rewards_coefficient, pad_id, device)

    def check(self, model) -> None:
        head_and_decoder(model)
        if not hasattr(peft_model(model), "peft_config"):
            raise RewardModelError(
                "rm needs a PEFT model (its score head is saved with the adapter)"
            )
        attach_score_head(model)

    def tokens(self, pair) -> int:
        return pair.n_tokens

    def counts(self, pairs) -> torch.Tensor:
        """This rank's ``[pairs]`` (the engine sums them over ranks)."""
        return torch.tensor([float(sum(p.n_examples for p in pairs))], device=self.device)

    def loss(self, model, pairs, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, metric sums)`` of one micro-batch under the global ``counts``."""
        batch = collate_pair_rows(pairs, self.pad_id, self.device)
        B = len(pairs)
        weight = torch.tensor([float(p.n_examples) for p in pairs], device=self.device)  # (B,)
        margin = torch.tensor([float(p.margin or 0.0) for p in pairs], device=self.device)
        rewards = sequence_rewards(model, batch, self.pad_id)  # (2B,)
        chosen, rejected = rewards[:B], rewards[B:]
        losses = reward_loss(chosen, rejected, margin, self.center)
        loss = (losses * weight).sum() / counts[0]
        c, r = chosen.detach(), rejected.detach()
        sums = torch.stack([((c > r).float() * weight).sum(), ((c - r) * weight).sum(),
                            ((c + r) / 2 * weight).sum()])  # fmt: skip
        return loss, sums

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Global metric sums -> per-pair means for the log."""
        n = max(float(counts[0]), 1.0)
        return {k: float(v) / n for k, v in zip(SUMS, sums.tolist())}
