"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, models, health, metrics.

::

    POST /v1/chat/completions   POST /v1/completions     (Bearer key when --api-key is set)
    GET  /v1/models             GET  /health (503 while loading)     GET /metrics (Prometheus)

``create_app(factory, settings)`` returns the app; the model is built by ``factory`` on the engine
thread when the app starts (see :mod:`kvtier.server.async_engine`), so ``/health`` answers at once.
A request is checked in this order: key (401), body shape (400), model name (404), parameters (400),
engine loaded and queue room (503 with ``Retry-After``), prompt (400, from the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.config import ConfigError
from kvtier.engine import LLMEngine, PromptType
from kvtier.outputs import RequestOutput
from kvtier.sampling_params import SamplingParams
from kvtier.server.async_engine import AsyncEngine, EngineDeadError, EngineNotReady, RequestStream
from kvtier.server.kv_routes import kv_router
from kvtier.server.metrics import ServerMetrics
from kvtier.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    validation_error,
)
from kvtier.server.responses import DONE, Formatter, Kind, sse

RETRY_AFTER_S = 1


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int | None = None


def _unavailable(message: str, code: str) -> APIError:
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return APIError(503, message, type="server_error", code=code, headers=headers)


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


def create_app(
    factory: Callable[[], LLMEngine],
    settings: ServerSettings,
    *,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The app; ``app.state.engine`` is its :class:`AsyncEngine`, ``app.state.metrics`` its metrics."""
    metrics = ServerMetrics(lambda: engine.stats)
    engine = AsyncEngine(factory, observer=metrics, max_queue=settings.max_queue, on_load_error=on_load_error)
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvtier", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.settings = settings

    # ------------------------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status == 400:
            metrics.reject("invalid_request")
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.reject("invalid_request")
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(EngineNotReady)
    async def _not_ready(request: Request, exc: EngineNotReady) -> JSONResponse:
        return _unavailable(str(exc), "model_not_ready").response()

    # ------------------------------------------------------------------------------- helpers
    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), settings.api_key.encode()
        ):
            raise APIError(
                401,
                "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_model(model: str | None) -> None:
        if model is not None and model != settings.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def admit(
        prompts: list[PromptType], params: SamplingParams, cache_salt: str | None, arrival: float, param: str
    ) -> list[RequestStream]:
        if not engine.ready:
            raise EngineNotReady(engine.not_ready_reason())
        if engine.overloaded(len(prompts)):
            metrics.reject("queue_full")
            raise _unavailable(
                f"the server is overloaded ({engine.queue_depth()} requests waiting, --max-queue "
                f"{engine.max_queue}); retry later",
                "queue_full",
            )
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                stream = await engine.add(prompt, params, cache_salt=cache_salt, arrival_time=arrival)
                streams.append(stream)
        except ConfigError as exc:
            for s in streams:
                s.abort()
            err = bad_request(exc, param)
            if "max_model_len" in str(exc):
                err.code = "context_length_exceeded"
            raise err from None
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def respond(
        request: Request,
        kind: Kind,
        streams: list[RequestStream],
        n: int,
        logprobs: bool,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        fmt = Formatter(
            kind,
            engine.engine.tokenizer,
            f"{prefix}-{uuid.uuid4().hex}",
            settings.model_name,
            n,
            logprobs=logprobs,
            include_usage=include_usage,
        )

        def abort_all() -> None:
            for s in streams:
                s.abort()

        if stream:

            async def chunks() -> AsyncIterator[str]:
                try:
                    async for chunk in fmt.stream(_merge(streams), len(streams)):
                        yield chunk
                except (EngineDeadError, EngineNotReady) as exc:
                    yield sse(APIError(500, str(exc), type="server_error").body())
                    yield DONE
                finally:
                    abort_all()

            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                chunks(),
                media_type="text/event-stream",
                headers=headers,
                background=BackgroundTask(abort_all),
            )

        async def collect() -> list[RequestOutput]:
            finals: dict[int, RequestOutput] = {}
            async for i, out in _merge(streams):
                if out.finished:
                    finals[i] = out
            return [finals[i] for i in range(len(streams))]

        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():  # the client left: abort, nobody will read the answer
                work.cancel()
                abort_all()
        if work.cancelled():
            return Response(status_code=499)
        try:
            finals = work.result()
        except (EngineDeadError, EngineNotReady) as exc:
            raise APIError(500, str(exc), type="server_error") from None
        return JSONResponse(fmt.response(finals))

    # ------------------------------------------------------------------------------------ routes
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(body.model)
        params = body.sampling_params()
        conversation = body.conversation()
        if not engine.ready:
            raise EngineNotReady(engine.not_ready_reason())
        tokenizer = engine.engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        except ConfigError as exc:
            raise bad_request(exc, "messages") from None
        # The template holds whatever special tokens it wants: no BOS added (as LLM.chat).
        prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        streams = await admit([prompt], params, body.cache_salt, arrival, "messages")
        logprobs = body.logprobs
        return await respond(request, "chat", streams, body.n, logprobs, body.stream, body.include_usage)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(body.model)
        params = body.sampling_params()
        given = body.prompts()
        if not engine.ready:
            raise EngineNotReady(engine.not_ready_reason())
        tokenizer = engine.engine.tokenizer
        prompts: list[PromptType] = [
            {"prompt": p, "prompt_token_ids": tokenizer.encode(p)} if isinstance(p, str) else p for p in given
        ]
        streams = await admit(prompts, params, body.cache_salt, arrival, "prompt")
        logprobs = body.logprobs is not None
        return await respond(request, "text", streams, body.n, logprobs, body.stream, body.include_usage)

    def model_card() -> dict[str, Any]:
        max_len = engine.engine.max_model_len if engine.ready else None
        return {
            "id": settings.model_name,
            "object": "model",
            "created": started,
            "owned_by": "kvtier",
            "max_model_len": max_len,
        }

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return model_card()

    app.include_router(v1)
    app.include_router(kv_router(engine, check_key, settings.model_name))  # GET /v1/kv/info, /v1/kv/blocks

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.ready:
            return JSONResponse({"status": "ok"})
        if engine.load_error is not None:
            return JSONResponse({"status": "error", "message": str(engine.load_error)}, status_code=503)
        status = "loading" if engine.loading else "stopped"
        return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
