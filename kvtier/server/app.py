"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, models, health, metrics.

::

    POST /v1/chat/completions   POST /v1/completions     (Bearer key when --api-key is set)
    GET  /v1/models             GET  /health (503 while loading)     GET /metrics (Prometheus)
    GET  /openapi.json          (the client key, as /v1)
    *    /v1/responses[/...]    501 not_supported: OpenAI's Responses API is not implemented
    POST /v1/messages           POST /v1/messages/count_tokens   (Anthropic's Messages API: :mod:`.messages`)

Chat takes tools (``tools``, ``tool_choice``, ``parallel_tool_calls``: :mod:`.tools`, :mod:`kvtier.tools`):
their schemas are checked on the tokenizer pool before the model is needed, the prompt renders them, and
the answer's text is parsed into ``tool_calls``. Both completion routes take kvtier's ``diagnostics:
{"previous_response_id": ...}`` and answer ``usage.kvtier.cache_miss_reason`` (:mod:`.diagnostics`).

Which key each route takes (client, KV reader, metrics, admin) is :mod:`.auth`'s table.

``create_app(factory, settings)`` returns the app; the model is built by ``factory`` on the engine
thread when the app starts (see :mod:`kvtier.server.async_engine`), so ``/health`` answers at once.
A request is checked in this order: body size and arrival time (413, 408: :mod:`.limits`), key (401),
body shape (400: parsed, its lists counted, then validated, off the event loop when big: :mod:`.bodies`),
shutting down (503), model name (404), parameters and ``--max-n`` (400), prompt length
(400; tokenized off the event loop: :mod:`.prompts`), engine loaded (503), a request that could never fit
``--max-queue`` (400), queue room (503 with ``Retry-After``), prompt (400, from the engine). Every error
is OpenAI's JSON shape, an unexpected one too (a 500 with the traceback in the log).

The routes and handlers are plain module-level functions; what they share lives on ``app.state``
(``engine``: the :class:`AsyncEngine`, ``metrics``, ``settings``, ``started``). The two completion
routes run in three steps::

    _open(request, body)         shutting down (503), model name (404), parameters (400); arrival time
    (the route's own)            its prompt input (400); opened.tokenizer() (503 while loading);
                                 the prompts rendered (chat template / tokenized text) on the pool
    opened.complete(...)         admit: fits the queue at all (400), queue room (503), engine.add (400)
                                 respond: an SSE stream, or one JSON body (499 if the client left)

With ``--prefix-cache-scope user`` every request's ``cache_salt`` is derived from its tenant (the API key
it presented and its ``user`` field: :func:`.protocol.tenant_salt`, which the router shares), so one
tenant's prompts are never a prefix-cache hit for another (see the README's Security section). On
SIGTERM the server drains (:mod:`.shutdown`): ``/health`` and new requests answer 503 while the running
ones finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from kvtier.config import ConfigError
from kvtier.engine import LLMEngine
from kvtier.kv.retention import RetentionSpan
from kvtier.outputs import RequestOutput
from kvtier.prompt_input import PromptType
from kvtier.sampling_params import SamplingParams
from kvtier.scheduler.admission import KVCapacityExceeded, QueueWaitExceeded
from kvtier.server import bodies, diagnostics, prompts, tools
from kvtier.server.async_engine import AsyncEngine, EngineDeadError, EngineNotReady, RequestStream
from kvtier.server.auth import check_distinct, check_key, check_kv_reader, check_metrics
from kvtier.server.dashboard import dashboard_router
from kvtier.server.error_handlers import (
    RETRY_AFTER_S,
    ShuttingDown,
    install_error_handlers,
    not_ready_error,
    unavailable,
)
from kvtier.server.kv_routes import kv_router
from kvtier.server.limits import RequestLimits
from kvtier.server.messages import Serving, messages_router
from kvtier.server.metrics import ServerMetrics
from kvtier.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    bad_request,
    check_model,
    clip,
    tenant_of,
    tenant_salt,
)
from kvtier.server.response_store import MAX_ENTRIES as MAX_STORED
from kvtier.server.response_store import open_response_store
from kvtier.server.responses import DONE, Formatter, Kind, sse
from kvtier.server.responses_background import BackgroundRuns
from kvtier.server.responses_route import responses_router
from kvtier.server.tokenize_routes import tokenize_router
from kvtier.tokenizer import Tokenizer

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
logger = logging.getLogger("kvtier.server")


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int | None = None
    max_n: int = 16  # most completions per prompt (n)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    timeout_body: float | None = 30.0  # seconds to receive a request's body (408 after)
    prefix_cache_scope: str = "shared"  # "user": the prefix cache is salted per tenant
    admin_key: str | None = None  # /admin/* (404 without it); never the api key (kvtier.server.auth)
    kv_read_key: str | None = None  # /v1/kv/blocks, canary, advice, dashboard (else the api key)
    metrics_key: str | None = None  # /metrics (open without it)
    reasoning_parser: str | None = None  # chat answers' <think> block apart (kvtier.reasoning)
    # Responses API answers kept for previous_response_id (kvtier.server.response_store): "memory" (this
    # replica's, the most recent max_stored_responses), "redis" (response_store_url's, shared), "off"
    response_store: str = "memory"
    response_store_url: str | None = field(default=None, repr=False)  # may hold a password
    response_store_secret: str | None = field(default=None, repr=False)  # signs what redis keeps
    max_stored_responses: int = MAX_STORED


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


def create_app(
    factory: Callable[[], LLMEngine],
    settings: ServerSettings,
    *,
    on_load_error: Callable[[BaseException], None] | None = None,
    on_ready: Callable[[LLMEngine], None] | None = None,
) -> FastAPI:
    """The app; ``app.state.engine`` is its :class:`AsyncEngine`, ``app.state.metrics`` its metrics.
    ``on_ready(engine)`` is called on the engine thread when the model has loaded. ConfigError when the
    admin key equals another key."""
    check_distinct(settings)
    metrics = ServerMetrics(lambda: engine.stats)
    engine = AsyncEngine(
        factory,
        observer=metrics,
        max_queue=settings.max_queue,
        on_load_error=on_load_error,
        on_ready=on_ready,
    )
    metrics.watch_kv_admission(lambda: engine.stats)
    app = FastAPI(title="kvtier", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.responses = open_response_store(
        settings.response_store,
        settings.response_store_url,
        settings.max_stored_responses,
        settings.response_store_secret,
    )
    app.state.background = BackgroundRuns()  # background responses running here
    app.state.started = int(time.time())
    app.state.draining = False  # set on SIGTERM (kvtier.server.shutdown)
    app.add_middleware(
        RequestLimits, max_bytes=settings.max_request_bytes, body_timeout=settings.timeout_body
    )
    install_error_handlers(app)
    app.include_router(v1)
    serving = Serving(admit, check_open, respond)
    app.include_router(messages_router(serving))  # Anthropic's /v1/messages
    app.include_router(responses_router(serving))  # OpenAI's /v1/responses
    app.include_router(kv_router())  # GET /v1/kv/info, /v1/kv/blocks, ...; POST /admin/kv/quarantine
    app.include_router(dashboard_router(app, check_kv_reader))  # GET /dashboard, /v1/kv/dashboard
    app.include_router(tokenize_router())  # POST /tokenize, /detokenize
    app.include_router(root)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine: AsyncEngine = app.state.engine
    app.state.pool = prompts.tokenizer_pool()
    engine.start()
    yield
    engine.abort_all(ShuttingDown("the server is shutting down"))
    await asyncio.to_thread(engine.shutdown)
    app.state.pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------- checks
def check_open(request: Request) -> None:
    """503 once the server is draining (SIGTERM): the router sends the request elsewhere."""
    if request.app.state.draining:
        raise ShuttingDown("the server is shutting down; retry on another replica")


def check_fits(engine: AsyncEngine, num_prompts: int, n: int, param: str) -> None:
    """400 for a request that could never be admitted: more sequences than ``--max-queue`` holds."""
    weight = num_prompts * n
    if not engine.fits(weight):
        raise APIError(
            400,
            f"this request runs {weight} sequences ({num_prompts} prompt(s) x n={n}); the server "
            f"queues at most {engine.max_queue} (--max-queue), so it can never be admitted: send fewer "
            "prompts or a smaller n",
            param="n" if n > 1 else param,
            code="request_too_large",
        )


# ----------------------------------------------------------------------------- admit and respond
async def admit(
    engine: AsyncEngine,
    metrics: ServerMetrics,
    prompts: list[PromptType],
    params: SamplingParams,
    *,
    cache_salt: str | None,
    arrival: float,
    param: str,
    priority: int = 0,
    tenant: str | None = None,
    grammar_param: str = "response_format",
    retention: tuple[RetentionSpan, ...] = (),
) -> list[RequestStream]:
    """One stream per prompt, or none: 503 while loading or when the queue is full, 400 when the request
    could never fit the queue or the engine rejects a prompt (naming ``param`` unless the message names
    a parameter, or ``grammar_param`` for a constraint that does not compile; the streams already added
    are aborted). A prompt weighs ``n`` sequences."""
    if not engine.ready:
        raise EngineNotReady(engine.not_ready_reason())
    check_fits(engine, len(prompts), params.n, param)
    weight = len(prompts) * params.n
    if engine.overloaded(weight):
        metrics.reject("queue_full")
        raise unavailable(
            f"the server is overloaded ({engine.queue_depth()} sequences waiting, --max-queue "
            f"{engine.max_queue}); retry later",
            "queue_full",
        )
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            stream = await engine.add(
                prompt,
                params,
                cache_salt=cache_salt,
                arrival_time=arrival,
                weight=params.n,
                priority=priority,
                tenant=tenant,
                retention=retention,
            )
            streams.append(stream)
    except (QueueWaitExceeded, KVCapacityExceeded, ConfigError) as exc:
        _abort_all(streams)
        raise _refusal(exc, metrics, param, grammar_param) from None
    except BaseException:
        _abort_all(streams)
        raise
    return streams


def _refusal(exc: Exception, metrics: ServerMetrics, param: str, grammar_param: str) -> APIError:
    """The answer to a request the engine refused: 503 past capacity, 400 for bad input."""
    if isinstance(exc, QueueWaitExceeded | KVCapacityExceeded):
        code = "queue_wait" if isinstance(exc, QueueWaitExceeded) else "kv_capacity"
        retry = exc.retry_after_s
        metrics.reject(code)
        headers = {"Retry-After": str(retry)}
        return APIError(503, str(exc), type="server_error", code=code, headers=headers)
    assert isinstance(exc, ConfigError)
    err = bad_request(exc)
    structured = str(exc).startswith("structured output")  # a schema or grammar that does not compile
    err.param = err.param or (grammar_param if structured else param)
    if "max_model_len" in str(exc):
        err.code = "context_length_exceeded"
    return err


async def respond(request: Request, fmt: Formatter, streams: list[RequestStream], stream: bool) -> Response:
    """The answer to one API call: server-sent events as the streams produce, or one JSON body."""
    if stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            _events(fmt, streams),
            media_type="text/event-stream",
            headers=headers,
            background=BackgroundTask(_abort_all, streams),
        )
    return await _json_body(request, fmt, streams)


async def _events(fmt: Formatter, streams: list[RequestStream]) -> AsyncIterator[str]:
    """The SSE chunks; an engine failure mid-stream ends it with an error event and ``[DONE]``."""
    try:
        async for chunk in fmt.stream(_merge(streams), len(streams)):
            yield chunk
    except EngineNotReady as exc:  # shutting down: the grace period is over
        yield sse(not_ready_error(exc).body())
        yield DONE
    except EngineDeadError as exc:
        yield sse(APIError(500, str(exc), type="server_error").body())
        yield DONE
    finally:
        _abort_all(streams)


async def _finals(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, out in _merge(streams):
        if out.finished:
            finals[i] = out
    return [finals[i] for i in range(len(streams))]


async def _json_body(request: Request, fmt: Formatter, streams: list[RequestStream]) -> Response:
    """Wait for every stream's final output, or for the client to leave (then abort them: 499)."""
    work = asyncio.ensure_future(_finals(streams))
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = not work.done()
        for task in (watch, work):
            task.cancel()
        await asyncio.gather(watch, work, return_exceptions=True)  # both settled: no stray exception
        if left:  # the client left (or we were cancelled): abort, nobody will read the answer
            _abort_all(streams)
    if left:
        return Response(status_code=499)
    try:
        finals = work.result()
    except EngineNotReady as exc:
        raise not_ready_error(exc) from None
    except EngineDeadError as exc:
        raise APIError(500, str(exc), type="server_error") from None
    body = fmt.response(finals)
    return JSONResponse(await body if inspect.isawaitable(body) else body)  # Responses: stored first


# ------------------------------------------------------------------------------ completion routes
@dataclass
class _Opened:
    """A completion request past its first checks (key, body shape, model name, parameters)."""

    request: Request
    body: GenerationRequest
    params: SamplingParams
    arrival: float  # time.monotonic() when the route was entered

    def tokenizer(self) -> tuple[Tokenizer, int]:
        """The model's tokenizer and ``max_model_len``; EngineNotReady (503) while the model loads."""
        return prompts.loaded_tokenizer(self.request.app.state.engine)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the tokenizer pool (never the event loop)."""
        return await prompts.off_loop(self.request.app.state.pool, fn, *args)

    async def complete(
        self,
        kind: Kind,
        given: list[PromptType],
        param: str,
        logprobs: bool,
        echo: bool = False,
        prompt_only: bool = False,
        tool_names: frozenset[str] | None = None,
    ) -> Response:
        """Admit the prompts (``param`` names the body field a rejected prompt came from) and respond;
        ``tool_names``: the answer's calls are parsed (chat with tools)."""
        body, state = self.body, self.request.app.state
        check_open(self.request)
        authorization = self.request.headers.get("authorization", "")
        salt = tenant_salt(authorization, body.user, body.cache_salt, state.settings.prefix_cache_scope)
        log = diagnostics.prompt_log(state)  # diagnostics.previous_response_id: why it missed (400 first)
        previous = diagnostics.previous_response_id(body.diagnostics)
        diagnose = diagnostics.explain(log, previous, given, salt, state.engine.block_size or 16)
        streams = await admit(
            state.engine,
            state.metrics,
            given,
            self.params,
            cache_salt=salt,
            arrival=self.arrival,
            param=param,
            priority=body.priority,
            tenant=tenant_of(authorization, body.user),
            grammar_param="tools" if tool_names is not None else "response_format",
            retention=body.retention,
        )
        tokenizer = state.engine.tokenizer
        assert tokenizer is not None  # admitted: the model has loaded
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        ttl_s = max((r.ttl_s for r in body.retention), default=None)
        diagnostics.record_answer(log, request_id, given, salt, ttl_s)
        fmt = Formatter(
            kind,
            tokenizer,
            request_id,
            state.settings.model_name,
            body.n,
            logprobs=logprobs,
            include_usage=body.include_usage,
            echo=echo,
            prompt_only=prompt_only,
            tool_names=tool_names,
            reasoning_parser=state.settings.reasoning_parser,
            diagnose=diagnose,
            tokens_as_ids=body.return_tokens_as_token_ids,
        )
        return await respond(self.request, fmt, streams, body.stream)


def _open(request: Request, body: GenerationRequest) -> _Opened:
    """The opening step of both completion routes: draining (503), model name (404), parameters (400)."""
    arrival = time.monotonic()
    check_open(request)
    settings: ServerSettings = request.app.state.settings
    check_model(settings.model_name, body.model)
    if body.n > settings.max_n:
        raise bad_request(f"n must be at most {settings.max_n} (--max-n), got {clip(body.n)}", "n")
    params = body.sampling_params()
    body.truncation()  # checked with the parameters, before the model is asked for
    return _Opened(request, body, params, arrival)


v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])


@v1.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = await bodies.parse(request, ChatCompletionRequest)  # the body's lists counted, then validated
    opened = _open(request, body)  # tools and tool_choice checked (400), a forced call's grammar built
    try:  # the constraint holds the answer alone; a thinking budget needs the parser
        opened.params.reason_first(request.app.state.settings.reasoning_parser)
    except ConfigError as exc:
        raise bad_request(exc, "thinking_token_budget") from None
    conversation = body.conversation()  # tool calls and results checked (400)
    given_tools, choice = body.tool_request()
    if given_tools:
        await opened.off_loop(tools.check_schemas, given_tools)  # 400 naming the tool
    tokenizer, max_model_len = opened.tokenizer()
    truncate = body.truncation()
    if truncate is None:  # a prompt to be cut may be longer than the context
        num_chars = sum(len(m["content"]) for m in conversation)
        prompts.check_chat_length(tokenizer, len(conversation), num_chars, max_model_len)
    prompt = await opened.off_loop(
        prompts.render_chat,
        tokenizer,
        conversation,
        opened.params.max_tokens,
        max_model_len,
        given_tools,
        body.template_args(),
        truncate,
    )
    names = frozenset(t.name for t in given_tools) if choice.mode != "none" else None
    return await opened.complete("chat", [prompt], "messages", logprobs=body.logprobs, tool_names=names)


@v1.post("/completions")
async def completions(request: Request) -> Response:
    body = await bodies.parse(request, CompletionRequest)
    opened = _open(request, body)
    given = body.prompts()
    check_fits(request.app.state.engine, len(given), body.n, "prompt")  # before tokenizing them all
    tokenizer, max_model_len = opened.tokenizer()
    truncate = body.truncation()
    for p in given if truncate is None else ():  # a prompt to be cut may be longer than the context
        if isinstance(p, str):
            prompts.check_text_length(tokenizer, len(p), max_model_len, "prompt")
        else:
            prompts.check_context(len(p), None, max_model_len, "prompt")
    encoded = await opened.off_loop(
        prompts.encode_prompts, tokenizer, given, opened.params.max_tokens, max_model_len, truncate
    )
    logprobs = body.logprobs is not None
    return await opened.complete(
        "text", encoded, "prompt", logprobs=logprobs, echo=body.echo, prompt_only=body.prompt_only
    )


# ---------------------------------------------------------------------------------- other routes
def _model_card(request: Request) -> dict[str, Any]:
    state = request.app.state
    engine: AsyncEngine = state.engine
    return {
        "id": state.settings.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "kvtier",
        "max_model_len": engine.max_model_len if engine.ready else None,
    }


@v1.get("/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(request)]}


@v1.get("/models/{model:path}")
async def model(model: str, request: Request) -> dict[str, Any]:
    check_model(request.app.state.settings.model_name, model)
    return _model_card(request)


root = APIRouter()


@root.get("/health")
async def health(request: Request) -> JSONResponse:
    engine: AsyncEngine = request.app.state.engine
    if request.app.state.draining:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse({"status": "draining"}, status_code=503, headers=headers)
    if engine.ready:
        return JSONResponse({"status": "ok", **_load(engine)})
    if engine.load_error is not None or engine.dead_error is not None:
        return JSONResponse({"status": "error", "message": engine.not_ready_reason()}, status_code=503)
    status = "loading" if engine.loading else "stopped"
    return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def _load(engine: AsyncEngine) -> dict[str, int]:
    """What a router weighs a replica by, cheaper to read than ``/metrics``: the running batch and the
    queue (as ``kvtier:num_requests_running`` / ``_waiting``, plus requests not handed to the engine yet)."""
    stats = engine.stats
    running = stats.num_requests_running if stats is not None else 0
    return {"num_requests_running": running, "num_requests_waiting": engine.queue_depth()}


@root.get("/openapi.json", include_in_schema=False, dependencies=[Depends(check_key)])
async def openapi(request: Request) -> JSONResponse:
    """The API's description, for clients only (the completion routes parse their bodies themselves:
    :mod:`.bodies`; their fields are OpenAI's, see :mod:`.protocol`)."""
    return JSONResponse(request.app.openapi())


@root.get("/metrics", dependencies=[Depends(check_metrics)])
async def prometheus_metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
