"""OpenAI response bodies: whole completions and server-sent-event chunks, for chat and legacy
completions, any number of choices, with or without logprobs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from lorafuse.generation import GenerationResult
from lorafuse.serve.logprobs import chat_logprobs, completion_logprobs
from lorafuse.serve.tools import parse_tool_calls


@dataclass
class Choice:
    """What one choice has received so far from its job's events."""

    index: int
    prompt_text: str  # shown before the completion when ``echo`` (legacy completions only)
    text: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)  # prompt entries (echo), then generated
    result: GenerationResult | None = None

    def offset(self) -> int:
        """Characters already in this choice's text: where the next entries' offsets start."""
        return sum(len(e["token"]) for e in self.entries)


def finish_reason(result: GenerationResult, called: bool = False) -> str:
    if called:
        return "tool_calls"
    return result.finish_reason if result.finish_reason in ("stop", "length") else "stop"


def assistant_message(text: str, tool_format: str | None) -> dict:
    """The reply as an assistant message: tool calls parsed out when the request had tools."""
    if tool_format is None:
        return {"role": "assistant", "content": text}
    content, calls = parse_tool_calls(text, tool_format)
    return {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})


def usage(results: list[GenerationResult], n: int) -> dict:
    """Each prompt counted once (``n`` choices share it), every choice's completion counted."""
    prompt = sum(r.prompt_tokens for r in results[::n])
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _logprobs(chat: bool, k: int | None, entries: list[dict], offset: int = 0):
    if k is None:
        return None
    return chat_logprobs(entries) if chat else completion_logprobs(entries, offset)


def full_response(req, rid: str, chat: bool, choices: list[Choice], k: int | None,
                  tool_format: str | None = None) -> dict:  # fmt: skip
    out = []
    for c in choices:
        text = "".join(c.text)
        body = {"index": c.index, "logprobs": _logprobs(chat, k, c.entries)}
        if chat:
            body["message"] = assistant_message(text, tool_format)
            body["finish_reason"] = finish_reason(c.result, "tool_calls" in body["message"])
        else:
            body["finish_reason"] = finish_reason(c.result)
            body["text"] = c.prompt_text + text
        out.append(body)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": out,
            "usage": usage([c.result for c in choices], req.n)}  # fmt: skip


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def chunk(req, rid: str, chat: bool, index: int, text: str | None = None, logprobs=None,
          finish: str | None = None, first: bool = False, tool_calls=None) -> str:  # fmt: skip
    choice = {"index": index, "logprobs": logprobs, "finish_reason": finish}
    if chat:
        delta = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:  # whole calls in one delta, indexed as OpenAI's streamed calls are
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": req.model, "choices": [choice]})  # fmt: skip


def delta_chunk(req, rid: str, chat: bool, k: int | None, c: Choice, text: str, entries) -> str:
    """A chunk carrying ``text`` and the entries of the tokens it shows; updates ``c``."""
    logprobs = _logprobs(chat, k, entries, c.offset())
    c.text.append(text)
    c.entries.extend(entries)
    return chunk(req, rid, chat, c.index, text, logprobs)


def tool_chunks(req, rid: str, k: int | None, c: Choice, tool_format: str):
    """The buffered reply of a request with tools, once complete: its content with the logprobs
    of every token, then its tool calls, then the finish chunk."""
    message = assistant_message("".join(c.text), tool_format)
    calls = message.get("tool_calls")
    if message["content"] or k is not None:
        yield chunk(req, rid, True, c.index, message["content"], _logprobs(True, k, c.entries))
    if calls:
        yield chunk(req, rid, True, c.index, tool_calls=calls)
    yield chunk(req, rid, True, c.index, finish=finish_reason(c.result, bool(calls)))


def usage_chunk(req, rid: str, chat: bool, choices: list[Choice]) -> str:
    return sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": req.model, "choices": [],
                "usage": usage([c.result for c in choices], req.n)})  # fmt: skip
