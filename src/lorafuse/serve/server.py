"""OpenAI-compatible HTTP API over one base model and any number of named LoRA adapters.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both
streaming as server-sent events in OpenAI's chunk format ending with ``data: [DONE]``), and
vLLM's GET /tokenizer_info, POST /tokenize, POST /detokenize (lm-eval's ``remote`` tokenizer:
a harness scores a model it has no tokenizer files for, a GGUF included).
Every model id maps to an adapter name (or None for the bare base); the one
``GenerationWorker`` decodes up to ``max_batch`` sequences together (continuous batching) and
activates each sequence's adapter for its forward. Errors use OpenAI's ``{"error": {...}}`` envelope.

A vision-language model (``processor`` given) takes OpenAI ``image_url`` content parts: data URLs,
and local files (a path or ``file://``) inside ``image_dir`` only. Nothing is fetched: a remote
URL is a 400, as is an image sent to a text-only model.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafuse.data.vision import DEFAULT_MAX_PIXELS, load_image
from lorafuse.data.vision_rows import prompt_inputs
from lorafuse.generation import (
    SamplingParams,
    chat_stop_ids,
    context_length,
    encode_messages,
    encode_prompt,
    resolve_engine,
)
from lorafuse.serve.responses import (
    Choice,
    chunk,
    delta_chunk,
    finish_reason,
    full_response,
    sse,
    tool_chunks,
    usage_chunk,
)
from lorafuse.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    Unsupported,
    error_body,
)
from lorafuse.serve.tools import template_message, tool_format
from lorafuse.serve.worker import GenerationWorker, Job

PROTECTED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")  # all but /health need the key

router = APIRouter()


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_="invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


@dataclass
class ServerState:
    """What every handler reads (``app.state.server``): the limits, the worker, and the
    encoding-side tokenizer and processor (copies: a Rust tokenizer shared with the worker's
    thread can raise "Already borrowed")."""

    model_ids: dict[str, str | None]  # public id -> adapter name (None = base)
    worker: GenerationWorker
    enc_tok: object
    enc_proc: object | None
    ctx_len: int
    vocab_size: int
    turn_stop_ids: tuple[int, ...]  # a chat reply ends at the end of its turn
    api_key: str | None
    max_body_bytes: int
    default_max_tokens: int
    max_n: int
    image_dir: str | None
    max_pixels: int
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(
    model, tokenizer, model_ids: dict[str, str | None], api_key: str | None = None,
    max_body_bytes: int = 1_000_000, default_max_tokens: int = 512, max_queue: int = 64,
    max_n: int = 8, processor=None, image_dir: str | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS, max_batch: int = 8, engine="auto",
) -> FastAPI:  # fmt: skip
    """``model_ids``: public id -> adapter name (None = base). The app owns a worker thread.
    A vision-language model (``processor``) decodes one sequence at a time: its prompts carry
    image tensors and M-RoPE positions the padded batch does not model. ``engine``: the decode
    engine (as :func:`lorafuse.generation.stream_generate` takes it; a VLM never has one)."""
    engine = None if processor is not None else resolve_engine(model, engine)
    worker = GenerationWorker(model, tokenizer, max_queue=max_queue, max_batch=max_batch,
                              batchable=processor is None, engine=engine)  # fmt: skip
    enc_tok = copy.deepcopy(tokenizer)  # encoding runs on the event loop while the worker decodes
    state = ServerState(
        model_ids=model_ids, worker=worker, enc_tok=enc_tok,
        enc_proc=copy.deepcopy(processor) if processor is not None else None,
        ctx_len=context_length(model),
        vocab_size=model.config.get_text_config().vocab_size,  # a VLM's config nests it
        turn_stop_ids=tuple(chat_stop_ids(enc_tok)), api_key=api_key,
        max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens, max_n=max_n,
        image_dir=image_dir, max_pixels=max_pixels,
    )  # fmt: skip
    app = FastAPI(title="lorafuse", docs_url=None, redoc_url=None)
    app.state.server, app.state.worker = state, worker
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.middleware("http")(_auth_and_size)
    app.include_router(router)
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.server


Server = Annotated[ServerState, Depends(_state)]


# ---- errors, auth, size ----------------------------------------------------------------------


async def _api_error(_req, err: APIError):
    return JSONResponse(err.body, status_code=err.status)


async def _http_error(_req, err: StarletteHTTPException):
    return JSONResponse(
        error_body(str(err.detail), code=err.status_code), status_code=err.status_code
    )


async def _internal(_req, err: Exception):
    return JSONResponse(
        error_body(f"internal error: {type(err).__name__}: {err}", "server_error"), 500
    )


async def _auth_and_size(request: Request, call_next):
    st = _state(request)
    if st.api_key and request.url.path.startswith(PROTECTED):
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), st.api_key.encode()):
            msg = (
                "Incorrect API key provided."
                if token
                else "Missing API key: send 'Authorization: Bearer <key>'."
            )
            return JSONResponse(error_body(msg, code="invalid_api_key"), status_code=401)
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > st.max_body_bytes:
        return JSONResponse(
            error_body(f"request body over {st.max_body_bytes} bytes", code="request_too_large"),
            413,
        )
    return await call_next(request)


async def parse(st: ServerState, request: Request, schema):
    """The request body as ``schema``, every problem an OpenAI-style 400 naming its field."""
    body = await request.body()
    if len(body) > st.max_body_bytes:  # chunked uploads carry no content-length
        raise APIError(
            413, f"request body over {st.max_body_bytes} bytes", code="request_too_large"
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
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, Unsupported):  # a field we do not implement: say which
            nested = param and not cause.field.startswith(param)
            where = f"{param}.{cause.field}" if nested else cause.field
            raise APIError(400, f"{cause} (in '{where}')" if nested else str(cause), param=where,
                           code="unsupported_parameter") from err  # fmt: skip
        raise APIError(400, f"invalid '{param}': {first['msg']}", param=param) from err
    if req.model is not None and req.model not in st.model_ids:
        raise APIError(404, f"The model '{req.model}' does not exist; available: {sorted(st.model_ids)}",
                       param="model", code="model_not_found")  # fmt: skip
    return req


# ---- health, models, tokenizer ---------------------------------------------------------------


@router.get("/health")
async def health(st: Server):
    worker = st.worker
    return {"status": "ok", "models": list(st.model_ids), "busy": worker.busy,
            "queue_depth": worker.queue_depth(), **worker.stats}  # fmt: skip


@router.get("/v1/models")
async def list_models(st: Server):
    ids = st.model_ids
    data = [{"id": mid, "object": "model", "created": st.created, "owned_by": "lorafuse",
             "parent": None if name is None else next(iter(ids))} for mid, name in ids.items()]  # fmt: skip
    return {"object": "list", "data": data}


@router.get("/tokenizer_info")
async def tokenizer_info(st: Server):
    tok = st.enc_tok
    return {"eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token,
            "chat_template": tok.chat_template, "model_max_length": st.ctx_len}  # fmt: skip


@router.post("/tokenize")
async def tokenize(request: Request, st: Server):
    req = await parse(st, request, TokenizeRequest)
    ids = st.enc_tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
    return {"tokens": list(ids), "count": len(ids), "max_model_len": st.ctx_len}


@router.post("/detokenize")
async def detokenize(request: Request, st: Server):
    req = await parse(st, request, DetokenizeRequest)
    vocab = st.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"token ids must lie in [0, {vocab})", param="tokens")
    return {"prompt": st.enc_tok.decode(req.tokens)}


# ---- generation ------------------------------------------------------------------------------


def make_jobs(st: ServerState, req, prompts: list[list[int]], inputs: dict | None = None,
              stop_ids: tuple[int, ...] = ()) -> list[Job]:  # fmt: skip
    """One job per (prompt, choice), all on one event queue; indices prompt-major, as OpenAI."""
    if req.n > st.max_n:
        raise APIError(
            400, f"n={req.n} is over this server's limit of {st.max_n} (--max-n)", param="n"
        )
    vocab, ctx_len = st.vocab_size, st.ctx_len
    bad = [t for t in req.logit_bias if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}", param="logit_bias"
        )
    jobs, events, loop = [], asyncio.Queue(), asyncio.get_running_loop()
    for i, ids in enumerate(prompts):
        room, limit = ctx_len - len(ids), req.limit()
        if not ids or room < 1 or (limit is not None and limit > room):
            raise APIError(400, f"This model's maximum context length is {ctx_len} tokens; you requested "
                           f"{len(ids)} prompt + {limit or 1} completion tokens.", param="messages",
                           code="context_length_exceeded")  # fmt: skip
        for j in range(req.n):
            # max_tokens=0 (echo only): the job generates nothing; SamplingParams wants >= 1
            params = SamplingParams(
                max_new_tokens=min(room, st.default_max_tokens) if limit is None else max(limit, 1),
                temperature=req.temperature,
                top_p=req.top_p, top_k=req.top_k, stop=req.stop, ignore_eos=req.ignore_eos,
                seed=None if req.seed is None else req.seed + j,  # n seeded choices differ
                logit_bias=req.logit_bias, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, stop_token_ids=list(stop_ids),
            )  # fmt: skip
            jobs.append(Job(st.model_ids[req.model], ids, params, loop, events, index=i * req.n + j,
                            logprobs=req.logprobs_k(), echo=getattr(req, "echo", False),
                            generate=limit != 0, inputs=inputs))  # fmt: skip
    if not st.worker.submit_all(jobs):
        raise APIError(503, "server busy: generation queue full, retry later", "server_error",
                       code="overloaded")  # fmt: skip
    return jobs


@router.post("/v1/chat/completions")
async def chat(request: Request, st: Server):
    req = await parse(st, request, ChatRequest)
    if st.enc_proc is not None:
        return await vision_chat(st, request, req)
    if any(m.image_urls() for m in req.messages):
        raise APIError(400, "image_url content parts need a vision-language model; "
                       f"{req.model} is text-only", param="messages")  # fmt: skip
    fmt, tools = None, None
    if req.tools and req.tool_choice != "none":  # "none": the model is not told of them
        fmt = tool_format(st.enc_tok.chat_template)
        if fmt is None:
            raise APIError(400, "this model's chat template has no tools support lorafuse can use "
                           "(it renders no 'tools', or teaches no call format it parses: "
                           "<tool_call> JSON or Llama 3 JSON)", param="tools")  # fmt: skip
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        messages = [template_message(m.for_template()) for m in req.messages]
        ids = encode_messages(st.enc_tok, messages, tools)
    except Exception as err:  # template errors (e.g. a role the template rejects)
        raise APIError(400, f"cannot apply the chat template: {err}", param="messages") from err
    jobs = make_jobs(st, req, [ids], stop_ids=st.turn_stop_ids)
    return await respond(req, jobs, [""] * len(jobs), chat=True, tool_format=fmt)


async def vision_chat(st: ServerState, request: Request, req):
    if req.tools and req.tool_choice != "none":
        raise APIError(400, "tools are not supported with a vision-language model", param="tools")
    images, image_dir = [], st.image_dir
    for k, url in enumerate(u for m in req.messages for u in m.image_urls()):
        try:
            if url.startswith("file://") or not url.startswith(("data:", "http:", "https:")):
                if image_dir is None:
                    raise ValueError("local image files are refused (start the server with "
                                     "--image-dir DIR to allow files under DIR)")  # fmt: skip
            images.append(load_image(url.removeprefix("file://"), image_dir or ".",
                                     st.max_pixels, allowed_dir=image_dir))  # fmt: skip
        except ValueError as err:
            raise APIError(400, f"image {k}: {err}", param="messages") from err
    try:
        messages = [m.for_vision_template() for m in req.messages]
        ids, extra = prompt_inputs(st.enc_proc, messages, images)
    except Exception as err:  # template or processor errors
        raise APIError(400, f"cannot apply the chat template: {err}", param="messages") from err
    jobs = make_jobs(st, req, [ids], extra, st.turn_stop_ids)
    return await respond(req, jobs, [""] * len(jobs), chat=True)


@router.post("/v1/completions")
async def completions(request: Request, st: Server):
    req = await parse(st, request, CompletionRequest)
    prompts = [
        encode_prompt(st.enc_tok, p) if isinstance(p, str) else list(p) for p in req.prompts()
    ]
    vocab = st.vocab_size
    if any(not 0 <= t < vocab for ids in prompts for t in ids):
        raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
    jobs = make_jobs(st, req, prompts)
    texts = [p if isinstance(p, str) else st.enc_tok.decode(p) for p in req.prompts()]
    echoed = [texts[job.index // req.n] if req.echo else "" for job in jobs]
    return await respond(req, jobs, echoed, chat=False)


async def respond(req, jobs: list[Job], echoed: list[str], chat: bool,
                  tool_format: str | None = None):  # fmt: skip
    """The reply to a generation request: a stream of events, or the whole response once every
    job is done."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    choices = [Choice(job.index, text) for job, text in zip(jobs, echoed)]
    if req.stream:
        events = stream_events(req, jobs, choices, rid, chat, tool_format)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip
    try:
        left = len(jobs)
        while left:
            index, kind, payload = await jobs[0].events.get()
            c = choices[index]
            if kind == "prompt":
                c.entries.extend(payload)
            elif kind == "delta":
                c.text.append(payload[0])
                c.entries.extend(payload[1])
            elif kind == "done":
                c.result, left = payload, left - 1
            else:
                raise APIError(500, f"generation failed: {payload}", "server_error")
    finally:
        for job in jobs:  # no-op when done; frees the worker if this request was cancelled
            job.cancel.set()
    return full_response(req, rid, chat, choices, req.logprobs_k(), tool_format)


async def stream_events(req, jobs: list[Job], choices: list[Choice], rid: str, chat: bool,
                        tool_format: str | None = None):  # fmt: skip
    """SSE body. A client that disconnects cancels this generator; ``finally`` stops the jobs.
    With tools the reply is held back until complete: a call is only known once parsed."""
    k = req.logprobs_k()
    try:
        if chat:
            for c in choices:
                yield chunk(req, rid, chat, c.index, first=True)
        left = len(jobs)
        while left:
            index, kind, payload = await jobs[0].events.get()
            c = choices[index]
            if kind == "prompt":  # echo: the prompt's text and entries come first
                yield delta_chunk(req, rid, chat, k, c, c.prompt_text, payload)
            elif kind == "delta" and tool_format:
                c.text.append(payload[0])
                c.entries.extend(payload[1])
            elif kind == "delta":
                yield delta_chunk(req, rid, chat, k, c, *payload)
            elif kind == "done":
                c.result, left = payload, left - 1
                if tool_format:
                    for body in tool_chunks(req, rid, k, c, tool_format):
                        yield body
                else:
                    yield chunk(req, rid, chat, c.index, finish=finish_reason(payload))
            else:
                yield sse(error_body(f"generation failed: {payload}", "server_error"))
                break
        if not left and req.include_usage():
            yield usage_chunk(req, rid, chat, choices)
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            job.cancel.set()
