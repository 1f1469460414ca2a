"""OpenAI-compatible HTTP API over one base model and any number of named LoRA adapters.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both
streaming as server-sent events in OpenAI's chunk format ending with ``data: [DONE]``).
Every model id maps to an adapter name (or None for the bare base); the single
``GenerationWorker`` selects it per job. Errors use OpenAI's ``{"error": {...}}`` envelope.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafuse.generation import (
    GenerationResult,
    SamplingParams,
    context_length,
    encode_messages,
    encode_prompt,
)
from lorafuse.serve.schemas import ChatRequest, CompletionRequest, error_body
from lorafuse.serve.worker import GenerationWorker, Job


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_="invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def create_app(
    model, tokenizer, model_ids: dict[str, str | None], api_key: str | None = None,
    max_body_bytes: int = 1_000_000, default_max_tokens: int = 512, max_queue: int = 64,
) -> FastAPI:  # fmt: skip
    """``model_ids``: public id -> adapter name (None = base). The app owns a worker thread."""
    app = FastAPI(title="lorafuse", docs_url=None, redoc_url=None)
    worker = GenerationWorker(model, tokenizer, max_queue=max_queue)
    # Encoding happens on the event loop while the worker decodes: separate tokenizer objects,
    # because a Rust tokenizer shared across threads can raise "Already borrowed".
    enc_tok = copy.deepcopy(tokenizer)
    ctx_len = context_length(model)
    created = int(time.time())
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def _api_error(_req, err: APIError):
        return JSONResponse(err.body, status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, err: StarletteHTTPException):
        return JSONResponse(
            error_body(str(err.detail), code=err.status_code), status_code=err.status_code
        )

    @app.exception_handler(Exception)
    async def _internal(_req, err: Exception):
        return JSONResponse(
            error_body(f"internal error: {type(err).__name__}: {err}", "server_error"), 500
        )

    @app.middleware("http")
    async def _auth_and_size(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                msg = (
                    "Incorrect API key provided."
                    if token
                    else "Missing API key: send 'Authorization: Bearer <key>'."
                )
                return JSONResponse(error_body(msg, code="invalid_api_key"), status_code=401)
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > max_body_bytes:
            return JSONResponse(
                error_body(f"request body over {max_body_bytes} bytes", code="request_too_large"),
                413,
            )
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": list(model_ids), "busy": worker.busy,
                "queue_depth": worker.queue_depth(), **worker.stats}  # fmt: skip

    @app.get("/v1/models")
    async def list_models():
        data = [{"id": mid, "object": "model", "created": created, "owned_by": "lorafuse",
                 "parent": None if name is None else next(iter(model_ids))} for mid, name in model_ids.items()]  # fmt: skip
        return {"object": "list", "data": data}

    async def parse(request: Request, schema):
        body = await request.body()
        if len(body) > max_body_bytes:  # chunked uploads carry no content-length
            raise APIError(
                413, f"request body over {max_body_bytes} bytes", code="request_too_large"
            )
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"malformed JSON body: {err}", code="invalid_json") from err
        if not isinstance(payload, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = schema.model_validate(payload)
        except ValidationError as err:
            first = err.errors()[0]
            param = ".".join(str(p) for p in first["loc"])
            raise APIError(400, f"invalid '{param}': {first['msg']}", param=param) from err
        if req.model not in model_ids:
            raise APIError(404, f"The model '{req.model}' does not exist; available: {sorted(model_ids)}",
                           param="model", code="model_not_found")  # fmt: skip
        return req

    def make_job(req, ids: list[int]) -> Job:
        room = ctx_len - len(ids)
        limit = req.limit()
        if room < 1 or (limit is not None and limit > room):
            raise APIError(400, f"This model's maximum context length is {ctx_len} tokens; you requested "
                           f"{len(ids)} prompt + {limit or 1} completion tokens.", param="messages",
                           code="context_length_exceeded")  # fmt: skip
        params = SamplingParams(
            max_new_tokens=limit or min(room, default_max_tokens), temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=req.stop, ignore_eos=req.ignore_eos,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        job = Job(model_ids[req.model], ids, params, loop, asyncio.Queue())
        if not worker.submit(job):
            raise APIError(
                503,
                "server busy: generation queue full, retry later",
                "server_error",
                code="overloaded",
            )
        return job

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in req.messages
        ]
        try:
            ids = encode_messages(enc_tok, messages)
        except Exception as err:  # template errors (e.g. a role the template rejects)
            raise APIError(400, f"cannot apply the chat template: {err}", param="messages") from err
        job = make_job(req, ids)
        return await respond(request, req, job, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        job = make_job(req, encode_prompt(enc_tok, req.prompt))
        return await respond(request, req, job, chat=False)

    async def respond(request: Request, req, job: Job, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(stream_events(req, job, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            text, result = [], None
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    text.append(payload)
                elif kind == "done":
                    result = payload
                    break
                else:
                    raise APIError(500, f"generation failed: {payload}", "server_error")
        finally:
            job.cancel.set()  # no-op when done; frees the worker if this request was cancelled
        return full_response(req, rid, chat, "".join(text), result)

    return app


def _usage(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}  # fmt: skip


def full_response(req, rid: str, chat: bool, text: str, result: GenerationResult) -> dict:
    finish = result.finish_reason if result.finish_reason in ("stop", "length") else "stop"
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": req.model, "choices": [choice], "usage": _usage(result)}  # fmt: skip


def _chunk(
    req, rid: str, chat: bool, content: str | None, finish: str | None, first: bool = False
) -> str:
    if chat:
        delta = (
            {"role": "assistant", "content": ""}
            if first
            else ({"content": content} if content else {})
        )
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": req.model, "choices": [choice]}  # fmt: skip
    return f"data: {json.dumps(body)}\n\n"


async def stream_events(req, job: Job, rid: str, chat: bool):
    """SSE body. A client that disconnects cancels this generator; ``finally`` stops the job."""
    try:
        if chat:
            yield _chunk(req, rid, chat, None, None, first=True)
        while True:
            kind, payload = await job.events.get()
            if kind == "delta":
                yield _chunk(req, rid, chat, payload, None)
            elif kind == "done":
                finish = (
                    payload.finish_reason if payload.finish_reason in ("stop", "length") else "stop"
                )
                yield _chunk(req, rid, chat, None, finish)
                if req.include_usage():
                    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": int(time.time()), "model": req.model, "choices": [], "usage": _usage(payload)}  # fmt: skip
                    yield f"data: {json.dumps(body)}\n\n"
                break
            else:
                yield f"data: {json.dumps(error_body(f'generation failed: {payload}', 'server_error'))}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()
