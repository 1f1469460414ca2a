"""OpenAI request bodies (pydantic) and the OpenAI error envelope.

Every field a client may send is either implemented or refused: an unknown field with a value
(not null) is a 400 naming it, never silently dropped. A null is the field's default, which is
what OpenAI's own clients send for "not given".
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 16


class Unsupported(ValueError):
    """A field this server does not implement (reported as 400 with the field as ``param``)."""

    def __init__(self, field: str, why: str = "is not supported by this server"):
        super().__init__(f"'{field}' {why}")
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")  # only nulls reach here, see _refuse_unknown

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data):
        if isinstance(data, dict):
            for key, value in data.items():
                if key not in cls.model_fields and value is not None:
                    raise Unsupported(key)
        return data


class _Request(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # extension (vLLM)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(default=1, ge=1)  # upper bound: the server's --max-n
    logit_bias: dict[int, float] | None = Field(default=None, validate_default=True)  # keys: ids
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    response_format: dict | None = None
    user: str | None = None  # an end-user id for abuse tracking: nothing to do with it here
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        # OpenAI allows 4; lm-eval sends a task's whole `until` list plus the EOS text (vLLM
        # takes any number). Each stop costs a substring search per token: 16 stays cheap.
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        if v and any(not -100 <= b <= 100 for b in v.values()):
            raise ValueError("logit_bias values must lie in [-100, 100]")
        return v or {}

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        kind = (v or {}).get("type", "text")
        if kind != "text":
            raise Unsupported(
                "response_format", f"type {kind!r} is not supported (no constrained decoding)"
            )
        return v

    @field_validator("stream_options")
    @classmethod
    def _usage_only(cls, v):
        for key in v or {}:
            if key != "include_usage":
                raise Unsupported(f"stream_options.{key}")
        return v

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn of tool calls only
    name: str | None = None  # passed to the chat template, which may use or ignore it
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates take it (developer is a system turn)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for key in ("name", "tool_call_id"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("strict")
    @classmethod
    def _not_strict(cls, v):
        if v:
            raise Unsupported("strict", "is not supported (no constrained decoding)")
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # every call the reply holds is returned

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v):
        if isinstance(v, dict) or v == "required":  # both need constrained decoding
            raise Unsupported("tool_choice", f"{v!r} is not supported; use 'auto' or 'none'")
        if v not in (None, "auto", "none"):
            raise ValueError("tool_choice must be 'auto' or 'none'")
        return v

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    # One prompt or a batch: text, or token ids (what lm-eval's local-completions sends).
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    # OpenAI's legacy default; 0 only with echo: score the prompt, generate nothing
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def _zero_needs_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 needs echo: true (it returns only the prompt)")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    def limit(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize`` (lm-eval's remote tokenizer uses it); ``model`` is optional:
    every model id shares the base's tokenizer."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
