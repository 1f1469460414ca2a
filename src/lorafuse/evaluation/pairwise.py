"""Pairwise accuracy of reward models (``lorafuse train --method rm``) on preference pairs.

A reward adapter is saved as PEFT ``task_type=SEQ_CLS`` with its ``score`` head in
``modules_to_save`` (:mod:`lorafuse.train.reward`): it is loaded here the way any transformers
user loads it, ``AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)`` plus
``PeftModel.from_pretrained``, and each pair (the same records ``rm`` trains on, margin ignored)
counts as right when the chosen sequence scores above the rejected one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafuse.dtypes import parse_dtype
from lorafuse.errors import LorafuseError


@dataclass
class PairwiseResult:
    n: int
    accuracy: float  # fraction of pairs with r(chosen) > r(rejected)
    margin: float  # mean r(chosen) - r(rejected)
    mean_reward: float  # mean over both sequences of every pair


def is_reward_adapter(path: str) -> bool:
    """True for an adapter saved by ``rm`` (SEQ_CLS with a ``score`` head)."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return False
    values = json.loads(config.read_text())
    return values.get("task_type") == "SEQ_CLS" and "score" in (values.get("modules_to_save") or [])


def load_reward_model(base_dir: str, adapter_dir: str, tokenizer, dtype=None):
    """The reward model as transformers + PEFT load it, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    if not is_reward_adapter(adapter_dir):
        raise LorafuseError(
            f"{adapter_dir}: not a reward-model adapter (train one with --method rm)"
        )
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            base_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id,
            dtype=parse_dtype(dtype) or torch.float32,
        )  # fmt: skip
        model = PeftModel.from_pretrained(model, adapter_dir)
    except (OSError, ValueError, KeyError) as err:
        raise LorafuseError(f"cannot load reward model {adapter_dir} on {base_dir}: {err}") from err
    return model.eval()


def _right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (rows, T), right-padded."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def pairwise_accuracy(model, pairs, pad_id: int, batch_size: int = 8) -> PairwiseResult:
    """Score every :class:`~lorafuse.data.preference.PairRow` (chosen and rejected in one batch)."""
    if not pairs:
        raise LorafuseError("pairwise accuracy: no preference pairs to score")
    device = next(model.parameters()).device
    right, margin, total = 0, 0.0, 0.0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        seqs = [p.chosen.input_ids for p in chunk] + [p.rejected.input_ids for p in chunk]
        ids, mask = _right_pad(seqs, pad_id)
        scores = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        scores = scores.float().squeeze(-1).cpu()  # (2B,)
        chosen, rejected = scores[: len(chunk)], scores[len(chunk) :]
        right += int((chosen > rejected).sum())
        margin += float((chosen - rejected).sum())
        total += float(scores.sum())
    n = len(pairs)
    return PairwiseResult(n, right / n, margin / n, total / (2 * n))


def score_adapters(base: str | None, adapters: dict[str, str], pair_files: list[str], *,
                   tokenizer_dir: str | None = None, max_seq_length: int = 1024,
                   limit: int | None = None, batch_size: int = 8, dtype=None,
                   data_split: str | None = None, data_subset: str | None = None,
                   data_columns: tuple[tuple[str, str], ...] = ()) -> dict[str, dict]:  # fmt: skip
    """``{adapter name: {"pairs": {n, accuracy, margin, mean_reward}}}``: every reward-model
    adapter on ``base`` (``None``: the built-in default) scored on the preference pairs of
    ``pair_files`` (the first ``limit``; ``data_columns`` as ``read_options.parse_columns``
    gives them), tokenized as ``rm`` tokenizes them."""
    from transformers import AutoTokenizer

    from lorafuse.data.dataset import DataSpec
    from lorafuse.data.preference import build_pairs
    from lorafuse.models.resolve import resolve_hf_dir

    if not adapters:
        raise LorafuseError("pairwise accuracy needs a reward-model adapter")
    base_dir = resolve_hf_dir(base)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or base_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = DataSpec(train_files=list(pair_files), max_seq_length=max_seq_length,
                    data_split=data_split, data_subset=data_subset,
                    data_columns=data_columns)  # fmt: skip
    pairs = build_pairs(data, tokenizer).train[:limit]
    columns = {}
    for name, path in adapters.items():
        model = load_reward_model(base_dir, path, tokenizer, dtype)
        r = pairwise_accuracy(model, pairs, tokenizer.pad_token_id, batch_size)
        columns[name] = {"pairs": {"n": r.n, "accuracy": r.accuracy, "margin": r.margin,
                                   "mean_reward": r.mean_reward}}  # fmt: skip
    return columns
