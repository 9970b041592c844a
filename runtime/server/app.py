"""The FastAPI app of `llmc serve`: OpenAI's `/v1/models`, `/v1/completions` and
`/v1/chat/completions` (streamed as server-sent events ending in `data: [DONE]`, or whole),
`/health` and Prometheus' `/metrics`. With a result cache (result_cache.py), a repeated request whose
output is determined is answered from it, whole or streamed, with the header `X-Cache: hit`.
Every error answers in OpenAI's envelope with the status
OpenAI's clients expect: 400 (not FastAPI's 422) naming the field, 401, 404, 413, 429, 500, 503,
body-parse failures and unknown routes included. The event loop only parses bodies (capped in
size) and moves results: templates and tokenisers run on prepare.py's thread, the model on
engine_loop.py's."""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import reprlib
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.errors import RuntimeLlmcError
from llmc.runtime.server.engine_loop import AsyncEngine, Job, Update
from llmc.runtime.server.limits import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from llmc.runtime.server.metrics import ServerMetrics
from llmc.runtime.server.prepare import Prepared, RequestPreparer
from llmc.runtime.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, ErrorResponse
from llmc.runtime.server.responses import ResponseBuilder
from llmc.runtime.server.result_cache import (
    CachedResult,
    ResultCache,
    is_determined,
    make_result_cache,
    ran_to_end,
    request_key,
)
from llmc.runtime.server.semantic_cache import make_semantic_cache

# What the /v1 routes may answer besides 200, for the OpenAPI schema (and the clients and fuzzers
# that read it): every error is OpenAI's envelope.
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 499, 500, 503)}
# A completion answers JSON, or server-sent events with `stream: true`: under OpenAPI 3.0/3.1 the
# text/event-stream schema describes one event (the generic one of the OpenAPI specification); each
# event's data is a JSON chunk, the last one "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer", "minimum": 0}}}
_COMPLETED = {200: {"content": {"application/json": {}, "text/event-stream": {"schema": _SSE_EVENT}}},
              **_ERRORS}


def _shown_repr() -> reprlib.Repr:
    """Request values as a 400's message shows them: a few characters, however large the value."""
    shown = reprlib.Repr()   # its keyword arguments are Python 3.12's
    shown.maxstring, shown.maxother, shown.maxlist, shown.maxdict, shown.maxlevel = 60, 60, 6, 6, 2
    return shown


_SHOWN = _shown_repr()


def build_app(engine, served_model_name: str | None = None, api_key: str | None = None, max_queue: int = 256,
              ttft_slo_ms: float | None = None, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              max_n: int = DEFAULT_MAX_N, metrics_need_key: bool = False, result_cache: int | str | None = None,
              result_cache_ttl: float | None = None, semantic_cache_threshold: float | None = None,
              semantic_cache_entries: int = 10_000, core=None) -> FastAPI:
    """An app serving `engine` (an `llmc.runtime.engine.Engine`, or `llmc.load(...)`'s LLM) under the
    model name `served_model_name` (default: the artifact's directory name). With `api_key`, the
    /v1 routes need `Authorization: Bearer <api_key>` (and /metrics too with `metrics_need_key`; by
    default it stays open for Prometheus, as vLLM's). `max_queue`: requests waiting beyond the
    engine's batch before 429s; `ttft_slo_ms`: refuse (429) requests predicted to miss it;
    `max_request_bytes`: a larger body is a 413, unread; `max_n`: the most choices (n) per request;
    `result_cache`: bytes ('256MiB', ...) of a cache of determined results (greedy or seeded), each
    kept `result_cache_ttl` seconds (None: until evicted); `semantic_cache_threshold`: the cosine
    similarity over which a request sent with `"semantic_cache": true` gets the result of an earlier
    one close in meaning (semantic_cache.py; at most `semantic_cache_entries` kept). `core`: what runs the
    requests in place of an AsyncEngine around `engine` (disaggregate/router.py's Router, its metrics its own)."""
    path, engine = getattr(engine, "path", None), getattr(engine, "engine", engine)
    name = served_model_name or (model_name(path) if path is not None else None)
    if not name:
        raise RuntimeLlmcError("build_app(engine) needs served_model_name=... (an Engine does not know its "
                               "artifact's path; an LLM from llmc.load does)")
    metrics = ServerMetrics(name) if core is None else core.metrics
    # The event loop's own copy (token texts of logprobs): a Rust tokenizer used from two threads at
    # once can fail "Already borrowed".
    tokenizer = copy.deepcopy(engine.tokenizer)
    core = core or AsyncEngine(engine, metrics, max_queue=max_queue, ttft_slo_ms=ttft_slo_ms)
    preparer = RequestPreparer(engine, max_n)
    results = make_result_cache(result_cache, result_cache_ttl)
    semantic = make_semantic_cache(engine, preparer, semantic_cache_threshold, semantic_cache_entries)

    async def answer(body, prepared: Prepared, builder: ResponseBuilder, request: Request, route: str):
        key = None
        if results is not None and is_determined(prepared.params):
            key = request_key(name, route, prepared.token_ids, prepared.params, body)
            hit = results.get(key)
            (metrics.result_cache_hits if hit is not None else metrics.result_cache_misses).inc()
            if hit is not None:
                return _replay(body, hit, builder, {"X-Cache": "hit"})
        near = None
        if semantic is not None and body.semantic_cache:
            near = await semantic.lookup(name, route, body, metrics)
            if near.hit is not None:
                return _replay(body, near.hit, builder, near.headers())
        stores = ([] if key is None else [lambda result: _store(results, key, result, metrics)]) + (
            [] if near is None else [near.store])
        store = (lambda result: [keep(result) for keep in stores]) if stores else None
        return await _serve(core, body, _job(engine, body, builder.request_id, prepared), builder, request, store)

    @asynccontextmanager
    async def lifespan(app):
        core.start()
        yield
        core.stop()
        preparer.close()

    app = FastAPI(title="llmc", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.state.core, app.state.model_name = core, name
    _add_error_handlers(app)
    auth = [Depends(_api_key_check(api_key))]

    @app.get("/health", response_class=Response, responses={200: {"description": "Serving (empty body)"},
                                                            503: {"description": "Shutting down (empty body)"}})
    async def health():
        return Response(status_code=200 if core.healthy else 503)

    @app.get("/metrics", dependencies=auth if metrics_need_key else [], response_class=PlainTextResponse,
             responses={401: {"model": ErrorResponse}})
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth, responses={401: {"model": ErrorResponse}})
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llmc",
                                            "root": name, "max_model_len": engine.max_model_len,
                                            "vocab_size": engine.model["vocab_size"]}]}

    @app.post("/v1/completions", dependencies=auth, responses=_COMPLETED)
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, name)
        builder = ResponseBuilder(f"cmpl-{uuid.uuid4().hex}", name, tokenizer, False, body.logprobs)
        prepared = await preparer.completion(body)
        return await answer(body, prepared, builder, request, "completions")

    @app.post("/v1/chat/completions", dependencies=auth, responses=_COMPLETED)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, name)
        top = (body.top_logprobs or 0) if body.logprobs else None
        builder = ResponseBuilder(f"chatcmpl-{uuid.uuid4().hex}", name, tokenizer, True, top)
        prepared = await preparer.chat(body)
        builder.tools = prepared.tools
        return await answer(body, prepared, builder, request, "chat")

    return app


def model_name(path) -> str:
    """The name an artifact is served under by default: its directory's, without `.llmc`."""
    return Path(path).name.removesuffix(".llmc")


def _check_model(asked: str, served: str) -> None:
    if asked != served:
        raise ApiError(404, f"The model `{asked}` does not exist; this server serves `{served}`",
                       param="model", code="model_not_found", kind="NotFoundError")


def _job(engine, body, request_id: str, prepared: Prepared) -> Job:
    return Job(request_id, body.user or "", body.priority, prepared.text, prepared.token_ids, prepared.params,
               engine.max_model_len)


def _store(results: ResultCache, key: bytes, result: CachedResult, metrics: ServerMetrics) -> None:
    """Keep a result that ran to its end (an aborted one is not the request's output)."""
    if ran_to_end(result):
        results.put(key, result)
        metrics.result_cache_bytes.set(results.bytes)


def _replay(body, hit: CachedResult, builder: ResponseBuilder, headers: dict):
    """A cached result as a fresh response (its own id), whole or as the stream it was made in."""
    if not body.stream:
        return JSONResponse(builder.body(hit.output), headers=headers)

    async def events():
        for event in _chunks(builder, hit.deltas, set()):
            yield event
        if body.include_usage:
            yield _sse(builder.usage_chunk(hit.output))
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


async def _serve(core: AsyncEngine, body, job: Job, builder: ResponseBuilder, request: Request, store=None):
    """Queue the job and answer it; the request is aborted if its client leaves before the end.
    `store(CachedResult)`, when given, keeps the finished result for the result cache."""
    core.submit(job)
    handed_over = False   # to the stream, which then aborts on its own
    headers = None if store is None else {"X-Cache": "miss"}
    try:
        update = await _next_update(job, request)   # errors before the first token keep their status
        if body.stream:
            handed_over = True
            return StreamingResponse(_events(core, job, update, builder, body.include_usage, store),
                                     media_type="text/event-stream", headers=headers)
        deltas = list(update.deltas)
        while not update.finished:
            update = await _next_update(job, request)
            deltas += update.deltas
        if store is not None:
            store(CachedResult(update.output, deltas))
        return JSONResponse(builder.body(update.output), headers=headers)
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


async def _events(core: AsyncEngine, job: Job, update: Update, builder: ResponseBuilder, include_usage: bool,
                  store=None):
    """Server-sent events from the first update on; starlette cancels this generator when the
    client disconnects, and the `finally` then aborts the request."""
    started: set[int] = set()
    deltas = []
    try:
        while True:
            for event in _chunks(builder, update.deltas, started):
                yield event
            deltas += update.deltas
            if update.finished:
                break
            update = await job.updates.get()
            if update.error is not None:
                yield _sse(update.error.body())
                break
        if update.output is not None and store is not None:
            store(CachedResult(update.output, deltas))
        if update.output is not None and include_usage:
            yield _sse(builder.usage_chunk(update.output))
        yield "data: [DONE]\n\n"
    finally:
        if not update.finished:
            core.abort(job.request_id)


def _chunks(builder: ResponseBuilder, deltas, started: set[int]):
    """Each delta's stream event; `started`: the choices whose first event went out (updated)."""
    for delta in deltas:
        yield _sse(builder.chunk(delta, first=delta.index not in started))
        started.add(delta.index)


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
        if first["type"] == "json_invalid":
            message = (f"the request body is not valid JSON: {first.get('ctx', {}).get('error')} at character "
                       f"{first['loc'][-1]}")
            return JSONResponse(ApiError(400, message).body(), status_code=400)
        field = ".".join(str(p) for p in first["loc"] if p != "body") or None
        message = f"{field or 'the request body'}: {first['msg']} (got {_SHOWN.repr(first.get('input'))})"
        return JSONResponse(ApiError(400, message, param=field).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        """Starlette's and FastAPI's own errors: unknown routes and methods, and bodies that do not
        decode (invalid UTF-8, an integer of over 4300 digits) with the decoder's reason."""
        cause = e.__cause__
        if e.status_code == 400 and cause is not None:
            message = f"the request body could not be parsed as JSON: {type(cause).__name__}: {str(cause)[:200]}"
        elif e.status_code in (404, 405):
            message = (f"{e.detail}: {request.method} {request.url.path}; this server answers GET /health, "
                       "GET /metrics, GET /v1/models, POST /v1/completions and POST /v1/chat/completions")
        else:
            message = str(e.detail)
        kind = "invalid_request_error" if e.status_code < 500 else "internal_server_error"
        return JSONResponse(ApiError(e.status_code, message, kind=kind).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):
        return JSONResponse(ApiError(500, f"the server failed on this request ({type(e).__name__}: {e}); this is a "
                                          "bug in llmc, please report it", kind="internal_server_error").body(),
                            status_code=500)
