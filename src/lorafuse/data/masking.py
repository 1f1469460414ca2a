"""Examples to token ids and labels: chat template, loss masking, truncation.

``encode(example, tokenizer, ...) -> Encoded(input_ids (T,), labels (T,))``, T <= max_seq_length.
Labels are ``-100`` (ignored by the loss) on every token that is not a target: by default only the
assistant turns of a chat (including the end-of-turn token, so the model learns to stop) and the
completion of a prompt/completion record are targets; ``train_on_inputs=True`` makes every token a
target. ``labels[0]`` is always -100: the first token is never predicted (the causal shift drops it),
and masking it keeps packed rows exact (the last token of one example must not learn to predict the
first token of the next).

How assistant tokens are found: the chat template renders the whole conversation once; for each
assistant turn the template also renders the conversation *up to* it (with the generation prompt)
and *including* it, and the characters in between are the turn. The rendered text is tokenized once
with character offsets, so tokenization is exactly what inference will see.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from lorafuse.data.formats import DataError, Example

IGNORE_INDEX = -100
TOO_LONG = ("truncate", "drop", "error")

# Used only when a tokenizer has no chat template (said out loud, see ensure_chat_template).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool = False

    @property
    def n_targets(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


def ensure_chat_template(tokenizer) -> None:
    """Give a template-less tokenizer the ChatML template, with a warning (chat data needs one)."""
    if getattr(tokenizer, "chat_template", None):
        return
    warnings.warn(
        "lorafuse: the tokenizer has no chat template; using ChatML (<|im_start|>role ... <|im_end|>). "
        "Set tokenizer.chat_template to your model's format if it has one.",
        UserWarning,
        stacklevel=2,
    )
    tokenizer.chat_template = CHATML_TEMPLATE


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def chat_segments(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages``; return ``(text, [(start, end) character spans of assistant turns])``."""
    text = _render(tokenizer, messages)
    spans = []
    search_from = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1])
        if i and upto.startswith(before) and text.startswith(upto):
            spans.append((len(before), len(upto)))
        else:  # templates that re-render earlier turns: fall back to the content itself
            start = text.find(msg["content"], search_from)
            if start < 0:
                raise ValueError(f"chat template output does not contain assistant turn {i}")
            spans.append((start, start + len(msg["content"])))
        search_from = spans[-1][1]
    return text, spans


def tokenize_with_spans(
    tokenizer, text: str, spans, add_special_tokens: bool
) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` and, per token, whether it starts inside one of ``spans``."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        inside = []
        for start, end in enc["offset_mapping"]:
            # overlap, not containment: a BPE token may straddle the border (" w|orld"), and a token
            # holding target characters must be predicted. Added specials (BOS) have span (0, 0).
            inside.append(end > start and any(start < e and end > s for s, e in spans))
        return ids, inside
    # slow tokenizers have no offsets: tokenize piece by piece (may differ at piece borders)
    ids, inside = [], []
    cuts = sorted({0, len(text), *[p for span in spans for p in span]})
    for a, b in zip(cuts, cuts[1:]):
        piece = tokenizer(text[a:b], add_special_tokens=add_special_tokens and a == 0)["input_ids"]
        target = any(s <= a < e for s, e in spans)
        ids += piece
        inside += [target] * len(piece)
    return ids, inside


def encode(
    example: Example,
    tokenizer,
    max_seq_length: int,
    *,
    train_on_inputs: bool = False,
    too_long: str = "truncate",
) -> Encoded | None:
    """Tokenize one example; ``None`` when it is dropped (too long with ``too_long='drop'``)."""
    if example.messages is not None:
        try:
            text, spans = chat_segments(tokenizer, example.messages)
        except Exception as err:  # jinja errors: roles the template rejects, etc.
            raise DataError(
                f"{example.source}: the chat template failed on this record ({err})"
            ) from None
        ids, inside = tokenize_with_spans(tokenizer, text, spans, add_special_tokens=False)
    else:
        text = example.prompt + example.completion
        spans = [(len(example.prompt), len(text))]
        ids, inside = tokenize_with_spans(tokenizer, text, spans, add_special_tokens=True)
        if tokenizer.eos_token_id is not None:  # learn to stop after the completion
            ids.append(tokenizer.eos_token_id)
            inside.append(True)
    labels = [t if (train_on_inputs or keep) else IGNORE_INDEX for t, keep in zip(ids, inside)]
    if labels:
        labels[0] = IGNORE_INDEX
    truncated = len(ids) > max_seq_length
    if truncated:
        if too_long == "error":
            raise DataError(
                f"{example.source}: record is {len(ids)} tokens, longer than max_seq_length="
                f"{max_seq_length} (use too_long=truncate or drop, or raise max_seq_length)"
            )
        if too_long == "drop":
            return None
        ids, labels = ids[:max_seq_length], labels[:max_seq_length]
    return Encoded(ids, labels, truncated)
