"""The FastAPI app of `llmc serve`: OpenAI's `/v1/models`, `/v1/completions` and
`/v1/chat/completions` (streamed as server-sent events ending in `data: [DONE]`, or whole),
`/health` and Prometheus' `/metrics`. Every error answers in OpenAI's envelope with the status
OpenAI's clients expect: 400 (not FastAPI's 422) naming the field, 401, 404, 429, 500, 503."""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmc.errors import RuntimeLlmcError
from llmc.runtime import request_values
from llmc.runtime.server.engine_loop import AsyncEngine, Job, Update
from llmc.runtime.server.metrics import ServerMetrics
from llmc.runtime.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from llmc.runtime.server.responses import ResponseBuilder


def build_app(engine, served_model_name: str | None = None, api_key: str | None = None, max_queue: int = 256,
              ttft_slo_ms: float | None = None) -> FastAPI:
    """An app serving `engine` (an `llmc.runtime.engine.Engine`, or `llmc.load(...)`'s LLM) under the
    model name `served_model_name` (default: the artifact's directory name). With `api_key`, the
    /v1 routes need `Authorization: Bearer <api_key>`. `max_queue`: requests waiting beyond the
    engine's batch before 429s; `ttft_slo_ms`: refuse (429) requests predicted to miss it."""
    path, engine = getattr(engine, "path", None), getattr(engine, "engine", engine)
    name = served_model_name or (model_name(path) if path is not None else None)
    if not name:
        raise RuntimeLlmcError("build_app(engine) needs served_model_name=... (an Engine does not know its "
                               "artifact's path; an LLM from llmc.load does)")
    metrics = ServerMetrics(name)
    # The handlers' own copy: a Rust tokenizer used from two threads at once can fail "Already borrowed".
    tokenizer = copy.deepcopy(engine.tokenizer)
    core = AsyncEngine(engine, metrics, max_queue=max_queue, ttft_slo_ms=ttft_slo_ms)

    @asynccontextmanager
    async def lifespan(app):
        core.start()
        yield
        core.stop()

    app = FastAPI(title="llmc", lifespan=lifespan)
    app.state.core, app.state.model_name = core, name
    _add_error_handlers(app)
    auth = [Depends(_api_key_check(api_key))]

    @app.get("/health")
    async def health():
        return Response(status_code=503 if core.draining else 200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llmc",
                                            "root": name, "max_model_len": engine.max_model_len,
                                            "vocab_size": engine.model["vocab_size"]}]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, name)
        text, ids = body.one_prompt()
        builder = ResponseBuilder(f"cmpl-{uuid.uuid4().hex}", name, tokenizer, False, body.logprobs)
        ids = ids if ids is not None else _encoded(tokenizer, text, "prompt")
        return await _serve(core, body, _job(engine, body, builder.request_id, text, ids, body.sampling_params(),
                                             "prompt"), builder, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, name)
        text = _chat_prompt(tokenizer, body.conversation())
        top = (body.top_logprobs or 0) if body.logprobs else None
        builder = ResponseBuilder(f"chatcmpl-{uuid.uuid4().hex}", name, tokenizer, True, top)
        ids = _encoded(tokenizer, text, "messages")
        return await _serve(core, body, _job(engine, body, builder.request_id, text, ids, body.sampling_params(),
                                             "messages"), builder, request)

    return app


def model_name(path) -> str:
    """The name an artifact is served under by default: its directory's, without `.llmc`."""
    return Path(path).name.removesuffix(".llmc")


def _check_model(asked: str, served: str) -> None:
    if asked != served:
        raise ApiError(404, f"The model `{asked}` does not exist; this server serves `{served}`",
                       param="model", code="model_not_found", kind="NotFoundError")


def _chat_prompt(tokenizer, conversation: list[dict]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "the served model has no chat template; use /v1/completions", param="messages")
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def _encoded(tokenizer, text: str, field: str) -> list[int]:
    try:
        return tokenizer(request_values.prompt_text(text, field))["input_ids"]
    except RuntimeLlmcError as e:
        raise ApiError(400, str(e), param=field) from None


def _job(engine, body, request_id: str, text, ids: list[int], params, field: str) -> Job:
    """The checked job of one request: a prompt longer than the context is a 400 with both lengths."""
    try:
        prompt_ids = engine.prompt_ids(None, ids, field)
    except RuntimeLlmcError as e:
        code = "context_length_exceeded" if "longer than the model's context" in str(e) else None
        raise ApiError(400, str(e), param=field, code=code) from None
    return Job(request_id, body.user or "", body.priority, text, prompt_ids, params, engine.max_model_len)


async def _serve(core: AsyncEngine, body, job: Job, builder: ResponseBuilder, request: Request):
    """Queue the job and answer it; the request is aborted if its client leaves before the end."""
    core.submit(job)
    handed_over = False   # to the stream, which then aborts on its own
    try:
        update = await _next_update(job, request)   # errors before the first token keep their status
        if body.stream:
            handed_over = True
            return StreamingResponse(_events(core, job, update, builder, body.include_usage),
                                     media_type="text/event-stream")
        while not update.finished:
            update = await _next_update(job, request)
        return JSONResponse(builder.body(update.output))
    finally:
        if not handed_over:
            core.abort(job.request_id)


async def _next_update(job: Job, request: Request) -> Update:
    """The job's next update; aborts it when the client disconnects meanwhile."""
    got = asyncio.ensure_future(job.updates.get())
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not got.done():
        got.cancel()
        raise ApiError(499, "the client closed the connection")
    update = got.result()
    if update.error is not None:
        raise update.error
    return update


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(core: AsyncEngine, job: Job, update: Update, builder: ResponseBuilder, include_usage: bool):
    """Server-sent events from the first update on; starlette cancels this generator when the
    client disconnects, and the `finally` then aborts the request."""
    started: set[int] = set()
    try:
        while True:
            for delta in update.deltas:
                yield _sse(builder.chunk(delta, first=delta.index not in started))
                started.add(delta.index)
            if update.finished:
                break
            update = await job.updates.get()
            if update.error is not None:
                yield _sse(update.error.body())
                break
        if update.output is not None and include_usage:
            yield _sse(builder.usage_chunk(update.output))
        yield "data: [DONE]\n\n"
    finally:
        if not update.finished:
            core.abort(job.request_id)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or wrong API key; send the header `Authorization: Bearer <key>` with "
                           "the key the server was started with (--api-key)", code="invalid_api_key")
    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_field(request, e: RequestValidationError):
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "body") or None
        shown = json.dumps(first.get("input"), default=str)[:80]
        message = f"{field or 'the request body'}: {first['msg']} (got {shown})"
        return JSONResponse(ApiError(400, message, param=field).body(), status_code=400)
