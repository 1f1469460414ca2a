"""Tool calling through the model's own chat template.

Tools are rendered by the template (``apply_chat_template(..., tools=...)``), so the model sees
them the way it was trained to. What it writes back is parsed by the format its template teaches:

- ``hermes`` (Qwen2.5 / Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, text around them is the message content;
- ``llama3_json`` (Llama 3.1+): the whole reply is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``, several joined by ``;``).

A template that never mentions ``tools`` cannot render them: the request is refused.
"""

from __future__ import annotations

import json
import re
import uuid

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_format(template: str | None) -> str | None:
    """The call format a chat template teaches, or None if it has no tools support we can parse."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template or "<|python_tag|>" in template:
        return "llama3_json"
    return None


def template_message(m: dict) -> dict:
    """An OpenAI message as HF chat templates take it: tool-call arguments as a dict, not JSON."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for call in m["tool_calls"]:
        fn = call["function"]
        try:
            args = (
                json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
            )
        except json.JSONDecodeError as err:
            raise ValueError(f"tool call {fn['name']!r} arguments are not JSON: {err}") from err
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": args}})  # fmt: skip
    return {**m, "tool_calls": calls}


def _call(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}  # fmt: skip


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply; a reply that is not a well-formed call stays content."""
    if fmt == "hermes":
        calls, kept = [], text
        for m in _HERMES.finditer(text):
            try:
                call = _call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
                kept = kept.replace(m.group(0), "", 1)
        kept = kept.strip()
        return (kept or None) if calls else text, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    try:
        objs = [json.loads(body)]
    except json.JSONDecodeError:
        try:
            objs = [json.loads(part) for part in body.split(";")]
        except json.JSONDecodeError:
            return text, []
    calls = [_call(obj) for obj in objs]
    return (None, calls) if calls and None not in calls else (text, [])
