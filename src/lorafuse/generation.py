"""Prompt building and token-by-token generation: what chat, infer, serve, eval and the demo share.

``stream_generate`` is a manual decoding loop over the KV cache: it yields text pieces as they
become printable, stops on EOS or a ``stop_token_ids`` token (a chat reply: the template's
end-of-turn token, ``chat_stop_ids``), on a stop string, at ``max_new_tokens`` or when
``should_stop()`` says so (a disconnected HTTP client), and reports token counts. Sampling: temperature, then
top-k, then top-p (nucleus) on the fp32 logits; temperature 0 is greedy. A per-call
``torch.Generator`` seeded from ``seed`` makes sampled outputs reproducible without touching
the global RNG.

Decoding runs on the decode engine (:mod:`lorafuse.decode`: prefill in chunks, one C++ call per
step for every running sequence, adapters unmerged per row) where it supports the model, else
on the model's own forward: ``engine="auto"`` (the default) asks
:func:`lorafuse.decode.engine_for`, which records why it cannot; ``engine=None`` forces the
model's forward; a :class:`~lorafuse.decode.DecodeEngine` is used as given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from lorafuse import decode
from lorafuse.errors import LorafuseError


def _cache_keyword() -> str:
    # transformers 5.x renamed past_key_values -> cache (the old name warns, then goes away).
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


CACHE_KW = _cache_keyword()  # the KV-cache keyword of model calls and outputs


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # generate exactly max_new_tokens (vLLM's extension; load tests)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0  # OpenAI's: minus this once for every token already generated
    frequency_penalty: float = 0.0  # minus this times how often the token was generated
    stop_token_ids: list[int] = field(
        default_factory=list
    )  # end generation too (chat: end of turn)

    def __post_init__(self) -> None:
        if (
            self.temperature < 0
            or not 0 < self.top_p <= 1
            or self.top_k < 0
            or self.max_new_tokens < 1
        ):
            raise LorafuseError(
                "sampling needs temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 1 "
                f"(got temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}, "
                f"max_new_tokens={self.max_new_tokens})"
            )


@dataclass
class GenerationResult:
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "length"  # "stop" | "length" | "cancelled"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` (and ``tools``, OpenAI's function specs) through the chat
    template, ending with the assistant prompt."""
    if not has_chat_template(tokenizer):
        raise ValueError(
            "the tokenizer has no chat template; use a plain prompt instead of messages"
        )
    out = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True
    )
    if hasattr(out, "keys"):  # transformers >= 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


_ANSWER = "lorafuse-probe-answer"


def end_of_turn_token(tokenizer) -> str | None:
    """The special token the chat template closes an assistant turn with (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``...), found by rendering one; None when the
    template has none. Often not the tokenizer's EOS (Gemma's is ``<eos>``, Phi-3's
    ``<|endoftext|>``, a base model's), so generating from a chat prompt must stop on it too."""
    if not has_chat_template(tokenizer):
        return None
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _ANSWER}]
    try:
        text = tokenizer.apply_chat_template(turn, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this has no answer to end
        return None
    after = text[text.rfind(_ANSWER) + len(_ANSWER) :].lstrip() if _ANSWER in text else ""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return next((s for s in sorted(specials, key=len, reverse=True) if after.startswith(s)), None)


def chat_stop_ids(tokenizer) -> list[int]:
    """``stop_token_ids`` for a reply to a chat-template prompt: the end-of-turn token's id."""
    token = end_of_turn_token(tokenizer)
    return [] if token is None else [int(tokenizer.convert_tokens_to_ids(token))]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Raw text completion: token ids of ``prompt`` (plus BOS if the tokenizer adds one)."""
    return list(tokenizer(prompt)["input_ids"])


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list | tuple) else [] if eos is None else [eos])
    return ids


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None
) -> torch.Tensor:
    """OpenAI's logit processing on (V,) fp32 logits, before temperature: penalties over the
    generated tokens' ``counts`` (V,), then ``logit_bias``."""
    if counts is not None:
        logits = logits - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    return logits


def top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits with every token outside the ``top_k`` highest (0: off) and outside the
    nucleus of probability ``top_p`` (1: off) set to -inf; the highest token always stays. The
    one top-k / top-p filter: serving, chat, infer and training rollouts all sample through it."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs >= top_p  # the first token is always kept
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick one token from (V,) logits (already through ``adjust_logits``)."""
    logits = logits.float()
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    logits = top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _find_stop(text: str, stops: list[str], start: int) -> int:
    """Index of the earliest stop string in ``text`` beginning at or after ``start`` - len(stop)."""
    hits = [i for s in stops if s and (i := text.find(s, max(0, start - len(s)))) >= 0]
    return min(hits) if hits else -1


class TokenStream:
    """The generated side of one sequence: draws each token from the model's logits with its own
    sampling settings (and seeded generator), ends on EOS, a stop token, a stop string or the
    length limit, and turns tokens into text pieces safe to show (no half UTF-8 character, no
    prefix of a stop string). :func:`stream_generate` and serve's batch scheduler both drive it,
    so a request decodes the same alone or in a batch.

    ``on_token(token, logits)`` sees every generated token, an ending EOS included (it counts in
    ``completion_tokens`` and OpenAI/vLLM logprobs list it), with the model's raw fp32 (V,)
    logits it was drawn from, before the piece that contains it is returned (serve's logprobs)."""

    def __init__(self, model, tokenizer, params: SamplingParams, result: GenerationResult,
                 on_token: Callable[[int, torch.Tensor], None] | None = None) -> None:  # fmt: skip
        self.tokenizer, self.params, self.result, self.on_token = (
            tokenizer,
            params,
            result,
            on_token,
        )
        self.gen = None
        if params.seed is not None:
            self.gen = torch.Generator(device="cpu").manual_seed(int(params.seed))
        self.stops = list(params.stop or [])
        self.eos = (
            set() if params.ignore_eos else eos_ids(model, tokenizer) | set(params.stop_token_ids)
        )
        self.penalize = bool(params.presence_penalty or params.frequency_penalty)
        self.counts: torch.Tensor | None = None
        self.generated: list[int] = []
        self.emitted = 0  # characters of the text already returned
        self.done = False
        self.last_token = -1  # the token to feed the model next

    def push(self, raw: torch.Tensor) -> str:
        """Draw the next token from raw (V,) fp32 ``logits``; returns the text now safe to show
        (maybe ""). Sets ``done`` when the sequence has ended (``result`` then holds its text)."""
        params, result = self.params, self.result
        if self.penalize and self.counts is None:
            self.counts = torch.zeros_like(raw)
        token = sample_next(adjust_logits(raw, params, self.counts), params, self.gen)
        result.completion_tokens += 1
        if self.on_token is not None:
            self.on_token(token, raw)
        if token in self.eos:
            result.finish_reason = "stop"
            return self._finish()
        if self.counts is not None:
            self.counts[token] += 1
        self.generated.append(token)
        self.last_token = token
        text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
        cut = _find_stop(text, self.stops, self.emitted)
        if cut >= 0:
            result.text, result.finish_reason, self.done = text[:cut], "stop", True
            return text[self.emitted : cut] if cut > self.emitted else ""
        # Hold back an incomplete UTF-8 sequence and a possible stop-string prefix.
        safe = len(text.rstrip("\ufffd"))
        if self.stops:
            safe = min(safe, max(self.emitted, len(text) - max(len(s) for s in self.stops) + 1))
        piece = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        result.text = text
        if result.completion_tokens >= params.max_new_tokens:
            result.finish_reason = "length"
            return piece + self._finish()
        return piece

    def _finish(self) -> str:
        self.done = True
        text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
        self.result.text, rest = text, text[self.emitted :]
        self.emitted = len(text)
        return rest


def resolve_engine(model, engine="auto"):
    """The decode engine to generate with: ``"auto"`` the model's (None where the engine cannot
    run it, the reason recorded), None the model's own forward, or the engine given."""
    if isinstance(engine, str):
        return decode.engine_for(model) if engine == "auto" else decode.engine_for(model, engine)
    return engine


def stream_generate(
    model,
    tokenizer,
    input_ids: list[int],
    params: SamplingParams,
    should_stop: Callable[[], bool] | None = None,
    result: GenerationResult | None = None,
    on_token: Callable[[int, torch.Tensor], None] | None = None,
    inputs: dict | None = None,
    engine="auto",
) -> Iterator[str]:
    """Yield new text pieces of one sequence (a :class:`TokenStream`, see it for ``on_token``);
    fills ``result`` (counts, finish_reason, full text) as it goes.

    ``inputs``: extra tensors of the prompt's forward only (a vision-language model's
    ``pixel_values``, ``image_grid_thw``...; the image features then live in the KV cache).
    ``engine``: see the module docstring (a call with ``inputs`` runs the model's forward)."""
    result = result if result is not None else GenerationResult()
    result.prompt_tokens = len(input_ids)
    stream = TokenStream(model, tokenizer, params, result, on_token)
    eng = None if inputs else resolve_engine(model, engine)
    steps = _engine_steps(eng, model, input_ids, params) if eng is not None else None
    if steps is None:
        steps = _model_steps(model, input_ids, inputs)
    with torch.inference_mode():
        try:
            token = None  # the prompt first
            while True:
                if should_stop is not None and should_stop():
                    result.finish_reason = "cancelled"
                    return
                piece = stream.push(steps.send(token))
                if piece:
                    yield piece
                if stream.done:
                    return
                token = stream.last_token
        finally:
            steps.close()


def _model_steps(model, input_ids: list[int], inputs: dict | None):
    """Next-token logits (V,) fp32 of the prompt, then of each token sent: the model's forward
    over its KV cache."""
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    past = None
    first = {k: v.to(device) for k, v in (inputs or {}).items()}
    while True:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_KW: past}, **first)
        first = {}
        past = getattr(out, CACHE_KW)
        token = yield out.logits[0, -1].float().cpu()
        ids = torch.tensor([[token]], device=device)


def _engine_steps(engine, model, input_ids: list[int], params: SamplingParams):
    """As :func:`_model_steps`, on the decode engine (the model's active adapter)."""
    seq = engine.open(decode.active_adapter(model), len(input_ids) + params.max_new_tokens)
    try:
        token = yield engine.prefill(seq, input_ids)
        while True:
            token = yield engine.step([seq], [token])[0]
    finally:
        engine.close(seq)


def generate_batch(model, tokenizer, prompts: list[list[int]], params: SamplingParams,
                   engine="auto", max_batch: int = 16) -> list[str]:  # fmt: skip
    """The completions' text of ``prompts``: on the decode engine (``engine`` as
    :func:`stream_generate` takes it) up to ``max_batch`` sequences decoded together, each
    joining when another ends; else batched ``model.generate`` with left padding."""
    eng = resolve_engine(model, engine)
    if eng is not None:
        return _engine_batch(eng, model, tokenizer, prompts, params, max_batch)
    pad = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else next(iter(eos_ids(model, tokenizer)))
    )
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: the newest token is always the last column
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    device = next(model.parameters()).device
    kwargs = dict(
        max_new_tokens=params.max_new_tokens, pad_token_id=pad, do_sample=params.temperature > 0
    )
    if params.stop_token_ids:  # a chat reply also ends at the end-of-turn token
        kwargs["eos_token_id"] = sorted(eos_ids(model, tokenizer) | set(params.stop_token_ids))
    if params.temperature > 0:
        kwargs.update(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None
        )
    if params.seed is not None:
        torch.manual_seed(int(params.seed))
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return [_truncate_at_stop(t, params.stop) for t in texts]


def _engine_batch(engine, model, tokenizer, prompts, params, max_batch: int) -> list[str]:
    """:func:`generate_batch` on the engine: continuous batching of :class:`TokenStream` s."""
    results = [GenerationResult(prompt_tokens=len(p)) for p in prompts]
    streams = [TokenStream(model, tokenizer, params, r) for r in results]
    adapter, waiting, running = decode.active_adapter(model), list(range(len(prompts))), []
    with torch.inference_mode():
        while waiting or running:
            while waiting and len(running) < max_batch:  # join: prefill, first token
                i = waiting.pop(0)
                seq = engine.open(adapter, len(prompts[i]) + params.max_new_tokens)
                streams[i].push(engine.prefill(seq, prompts[i]))
                running.append((i, seq))
            running = [(i, s) for i, s in running if not streams[i].done or engine.close(s)]
            if not running:
                continue
            logits = engine.step(
                [s for _, s in running], [streams[i].last_token for i, _ in running]
            )
            for row, (i, _) in enumerate(running):
                streams[i].push(logits[row])
            running = [(i, s) for i, s in running if not streams[i].done or engine.close(s)]
    return [r.text for r in results]


def _truncate_at_stop(text: str, stops: list[str]) -> str:
    cut = _find_stop(text, stops or [], 0)
    return text[:cut] if cut >= 0 else text


def context_length(model) -> int:
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg  # VLMs nest it
    return int(getattr(cfg, "max_position_embeddings", 0) or 2048)
