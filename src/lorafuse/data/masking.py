"""Examples to token ids and labels: chat template, loss masking, truncation.

``encode(example, tokenizer, ...) -> Encoded(input_ids (T,), labels (T,))``, T <= max_seq_length.
Labels are ``-100`` on every token that is not a target: by default the assistant turns (with
their end-of-turn token) and a completion; ``train_on_inputs=True`` makes every token one.
``labels[0]`` is always -100 (never predicted; keeps packed rows exact). Assistant turns are found
by rendering the conversation up to and including each turn; ``think_tokens`` decides which
``<think>`` blocks are targets. How: docs/training.md.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from lorafuse.data.formats import DataError, Example

IGNORE_INDEX = -100
TOO_LONG = ("truncate", "drop", "error")
THINK_TOKENS = ("mask-empty", "train", "mask-all")
# a reasoning block and the newlines the template writes after it (Qwen3 two, SmolLM3 one)
THINK_BLOCK = re.compile(r"<think>(.*?)</think>\n*", re.S)

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


def for_template(tokenizer, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """``messages`` as the template gets them: ``reasoning_content`` kept where the template
    reads it, else written into the content as a ``<think>`` block (never dropped silently)."""
    if not any("reasoning_content" in m for m in messages):
        return messages
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "reasoning_content" in template:
        return messages
    out = []
    for m in messages:
        if "reasoning_content" in m:
            m = dict(m)
            block = f"<think>\n{m.pop('reasoning_content').strip()}\n</think>\n\n"
            m["content"] = block + m["content"]
        out.append(m)
    return out


def _visible(content: str) -> str:
    """What a reasoning template shows of an earlier turn's content: the part after ``</think>``."""
    return content.split("</think>")[-1].lstrip("\n") if "</think>" in content else content


def _rerendered_span(text: str, before: str, upto: str, content: str, search_from: int, i: int):
    """The span of assistant turn ``i`` in ``text`` when the template renders it differently once
    later turns follow: from the end of its generation prompt (or its content) to the end of the
    end-of-turn text the template writes after the content when the turn is last."""
    shown = content
    start = text.find(content, search_from)
    if start < 0 and _visible(content) != content:
        shown = _visible(content)
        start = text.find(shown, search_from)
    if start < 0:
        raise ValueError(f"chat template output does not contain assistant turn {i}")
    begin = (
        len(before) if text.startswith(before) and search_from <= len(before) <= start else start
    )
    end = start + len(shown)
    at = upto.rfind(shown)
    tail = upto[at + len(shown) :] if at >= 0 else ""
    n = 0  # the end-of-turn text both renderings share (not the conversation's closing EOS)
    while n < len(tail) and end + n < len(text) and text[end + n] == tail[n]:
        n += 1
    return begin, end + n


def _had_reasoning(msg: dict) -> bool:
    return bool(msg.get("reasoning_content")) or "</think>" in msg["content"]


def chat_segments(
    tokenizer, messages: list[dict[str, str]], think_tokens: str = "train"
) -> tuple[str, list[list[tuple[int, int]]]]:
    """Render ``messages``; return ``(text, spans)``: per assistant turn, the ``(start, end)``
    character spans of its target text, its reasoning blocks cut as ``think_tokens`` says. Under
    ``mask-empty`` a turn whose reasoning the template dropped (Qwen3's earlier turns) has none:
    its answer without its reasoning would teach the model to answer without thinking."""
    if think_tokens not in THINK_TOKENS:
        raise ValueError(f"think_tokens={think_tokens!r}: one of {' | '.join(THINK_TOKENS)}")
    messages = for_template(tokenizer, messages)
    text = _render(tokenizer, messages)
    spans = []
    search_from = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1])
        if i and upto.startswith(before) and text.startswith(upto):
            span = (len(before), len(upto))
        else:
            span = _rerendered_span(text, before, upto, msg["content"], search_from, i)
        search_from = span[1]
        dropped = _had_reasoning(msg) and "</think>" not in text[span[0] : span[1]]
        if dropped and think_tokens == "mask-empty":
            spans.append([])
        else:
            spans.append(_cut_think(text, span, think_tokens))
    return text, spans


def _cut_think(text: str, span: tuple[int, int], think_tokens: str) -> list[tuple[int, int]]:
    """``span`` less the ``<think>`` blocks inside it that ``think_tokens`` masks."""
    s, e = span
    if think_tokens == "train":
        return [span]
    out, pos = [], s
    for m in THINK_BLOCK.finditer(text, s, e):
        if think_tokens == "mask-all" or not m.group(1).strip():
            if m.start() > pos:
                out.append((pos, m.start()))
            pos = m.end()
    if pos < e:
        out.append((pos, e))
    return out


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
    think_tokens: str = "mask-empty",
) -> Encoded | None:
    """Tokenize one example; ``None`` when it is dropped (too long with ``too_long='drop'``).
    ``think_tokens``: which reasoning blocks of assistant turns are targets (docs/training.md)."""
    if think_tokens not in THINK_TOKENS:
        raise DataError(f"think_tokens={think_tokens!r}: one of {' | '.join(THINK_TOKENS)}")
    if example.messages is not None:
        try:
            text, turns = chat_segments(tokenizer, example.messages, think_tokens)
        except Exception as err:  # jinja errors: roles the template rejects, etc.
            raise DataError(
                f"{example.source}: the chat template failed on this record ({err})"
            ) from None
        spans = [span for turn in turns for span in turn]
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
