"""Perplexity over a dataset's target tokens and exact-match / contains accuracy on a JSONL task.

Perplexity uses the training pipeline's own tokenization and masking
(``lorafuse.data.masking.encode``): chat records score the assistant turns, prompt/completion
records the completion, text records every token; so an eval here matches the trainer's eval
loss. ``ppl = exp(sum NLL / number of target tokens)``, summed over the whole dataset (not a
mean of per-record perplexities).

Task accuracy (records ``{"messages": [...], "answer": "..."}``, or ``{"prompt": "...", "answer":
"..."}`` for a one-turn question): greedy generation through the chat template; ``exact_match``
compares the stripped completion with the stripped answer, ``contains`` checks the answer occurs
anywhere in the completion. Both read any source the trainer reads (files, Hugging Face datasets)
with its :class:`~lorafuse.data.read_options.ReadOptions` (split, subset, column mapping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lorafuse.data.formats import DataError, source_rows
from lorafuse.data.read_options import ReadOptions, map_columns
from lorafuse.errors import LorafuseError
from lorafuse.generation import SamplingParams, chat_stop_ids, encode_messages, generate_batch

IGNORE_INDEX = -100


@dataclass
class TaskResult:
    n: int = 0
    exact: int = 0
    contains: int = 0
    samples: list[dict] = field(default_factory=list)  # first few predictions, for the JSON report
    predictions: list[str] = field(default_factory=list)  # every prediction, when asked for

    @property
    def exact_match(self) -> float:
        return self.exact / max(self.n, 1)

    @property
    def contains_rate(self) -> float:
        return self.contains / max(self.n, 1)


def encode_dataset(paths: list[str], tokenizer, max_seq_length: int, limit: int | None = None,
                   all_tokens=False, options: ReadOptions | None = None):  # fmt: skip
    """[(input_ids, labels)] for the perplexity datasets (training's reader + masking)."""
    from lorafuse.data.formats import read_examples
    from lorafuse.data.masking import encode, ensure_chat_template

    try:
        examples = read_examples(paths, options=options)[:limit]
        if any(ex.messages is not None for ex in examples):
            ensure_chat_template(tokenizer)
        encoded = [
            encode(ex, tokenizer, max_seq_length, train_on_inputs=all_tokens) for ex in examples
        ]
    except DataError as err:
        raise LorafuseError(str(err)) from err
    return [(e.input_ids, e.labels) for e in encoded if e is not None and e.n_targets > 0]


def perplexity(
    model, rows: list[tuple[list[int], list[int]]], batch_size: int = 4, desc="perplexity"
) -> dict:
    """{'perplexity', 'nll', 'tokens'} over the target tokens of ``rows`` (right-padded batches)."""
    total_nll, total_tokens = 0.0, 0
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))  # less padding
    with torch.inference_mode():
        for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch", leave=False):
            batch = [rows[i] for i in order[start : start + batch_size]]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, (x, y) in enumerate(batch):
                ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = (
                    torch.tensor(x),
                    torch.tensor(y),
                    1,
                )
            logits = model(
                input_ids=ids.to(device), attention_mask=mask.to(device)
            ).logits.float()  # (B, T, V)
            shift_labels = labels[:, 1:].to(device)  # token t is predicted from positions < t
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                  ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
            total_nll += float(nll)
            total_tokens += int((shift_labels != IGNORE_INDEX).sum())
    if total_tokens == 0:
        raise LorafuseError("no target tokens to score in the perplexity data")
    mean = total_nll / total_tokens
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": total_tokens}


def read_task(
    path: str, limit: int | None = None, options: ReadOptions | None = None
) -> list[dict]:
    """Task records ``{"messages": [...], "answer": str}`` (a ``prompt`` string becomes one user
    turn); errors name the source and line."""
    options = options or ReadOptions(role="eval")
    records = []
    try:
        label, rows = source_rows(path, options)
        for lineno, rec in rows:
            if isinstance(rec, DataError):
                raise rec
            if not isinstance(rec, dict):
                raise LorafuseError(
                    f"{label}:{lineno}: expected an object, got {type(rec).__name__}"
                )
            try:
                rec = map_columns(rec, options.columns)
            except ValueError as err:
                raise LorafuseError(f"{label}:{lineno}: {err}") from None
            if isinstance(rec.get("prompt"), str) and "messages" not in rec:
                rec = {**rec, "messages": [{"role": "user", "content": rec["prompt"]}]}
            msgs = rec.get("messages")
            if hasattr(msgs, "tolist"):  # numpy arrays from parquet
                msgs = rec["messages"] = msgs.tolist()
            if not (isinstance(msgs, list) and msgs and isinstance(rec.get("answer"), str)):
                raise LorafuseError(f"{label}:{lineno}: a task record needs 'messages' (list) or "
                                    "'prompt' (string), and 'answer' (string)")  # fmt: skip
            records.append(rec)
            if limit is not None and len(records) >= limit:
                break
    except DataError as err:
        raise LorafuseError(str(err)) from err
    if not records:
        raise LorafuseError(f"{path}: no task records")
    return records


def task_accuracy(model, tokenizer, records: list[dict], max_new_tokens: int = 32, batch_size: int = 8,
                  desc: str = "task", keep_predictions: bool = False,
                  engine="auto") -> TaskResult:  # fmt: skip
    """Greedy answers to ``records`` ({"messages", "answer"}) scored by exact match and contains
    (``engine``: as :func:`lorafuse.generation.generate_batch` takes it)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=chat_stop_ids(tokenizer))  # fmt: skip
    result = TaskResult()
    for start in tqdm(range(0, len(records), batch_size), desc=desc, unit="batch", leave=False):
        batch = records[start : start + batch_size]
        prompts = [encode_messages(tokenizer, r["messages"]) for r in batch]
        for rec, pred in zip(batch, generate_batch(model, tokenizer, prompts, params, engine)):
            answer, pred_s = rec["answer"].strip(), pred.strip()
            result.n += 1
            result.exact += int(pred_s == answer)
            result.contains += int(answer in pred)
            if keep_predictions:
                result.predictions.append(pred_s)
            if len(result.samples) < 5:
                result.samples.append({"answer": rec["answer"], "prediction": pred})
    return result
