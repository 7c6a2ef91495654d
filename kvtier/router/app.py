"""The router's HTTP API: the replicas' OpenAI API, passed through, plus its own state and admin routes.

::

    POST /v1/chat/completions  POST /v1/completions    choose a replica (kvtier.router.core), forward
    GET  /v1/models  GET /v1/models/{id}               forwarded to a healthy replica
    POST /tokenize   POST /detokenize                  forwarded to a healthy replica
    GET  /health     200 while some replica is healthy, else 503
    GET  /metrics    the router's own metrics (kvtier_router:..., kvtier.router.metrics)
    GET  /router/state                                 mode, policy, tokenizer, each replica
    POST /router/explain  {"endpoint": "chat"|"completions", "request": {...}}
                         the decision and block hashes the router would use, without sending
    POST /admin/replicas {"url": ...}   DELETE /admin/replicas {"url": ...}   add or remove a replica

The ``/v1``, ``/router/explain`` and ``/admin`` routes need ``Authorization: Bearer <--api-key>`` when the
router has one; the client's header is passed on to the replica, and the router's own calls to the
replicas (``/v1/kv/...``) carry the key. Errors are OpenAI's JSON shape; a replica's own errors (400 for
a bad body, 404 for an unknown model...) come back to the client unchanged.

Plain Starlette, not FastAPI (whose import alone costs more than half a second): the router answers
within well under a second of starting; the replica's request models (``kvtier.server.protocol``) are
imported on the tokenizer thread, meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as Endpoint

from kvtier.router.core import NoReplica, Route, Router, RouterSettings
from kvtier.router.errors import RouterError
from kvtier.router.policy import Decision
from kvtier.router.prompt import CHAT_PATH, COMPLETIONS_PATH
from kvtier.router.proxy import forward
from kvtier.server.dashboard import page_routes

logger = logging.getLogger("kvtier.router")
Handler = Callable[[Request], Awaitable[Response]]


def create_app(settings: RouterSettings) -> Starlette:
    """The app; ``app.state.router`` is its :class:`Router` (started with the app's lifespan)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(10.0))
    handlers = {RouterError: _router_error, HTTPException: _http_error, NoReplica: _no_replica}
    app = Starlette(routes=ROUTES, lifespan=_lifespan, exception_handlers=handlers)  # type: ignore[arg-type]
    app.state.router = Router(settings, client)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    router: Router = app.state.router
    router.load_tokenizer_in_background()
    tasks = [asyncio.create_task(coro) for coro in router.background_tasks()]
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await router.client.aclose()
    router.pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------- errors
async def _router_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return RouterError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


async def _no_replica(request: Request, exc: Exception) -> Response:
    request.app.state.router.metrics.failures.labels("no_replica").inc()
    message = "no healthy replica to serve the request; retry later"
    headers = {"Retry-After": "1"}
    return RouterError(
        503, message, type="server_error", code="no_healthy_replica", headers=headers
    ).response()


def check_key(request: Request) -> None:
    """401 unless the request carries the router's ``--api-key`` (when it has one)."""
    api_key = request.app.state.router.settings.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise RouterError(
            401,
            "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def keyed(handler: Handler) -> Handler:
    """``handler`` behind :func:`check_key`."""

    async def checked(request: Request) -> Response:
        check_key(request)
        return await handler(request)

    return checked


async def read_body(request: Request) -> bytes:
    """The body, at most ``--max-request-bytes`` (413 beyond, as the replicas answer)."""
    limit = request.app.state.router.settings.max_request_bytes
    too_large = RouterError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # forwarded as is: the replica answers its own 400


# ---------------------------------------------------------------------------------------- routes
async def _generate(request: Request, path: str) -> Response:
    router: Router = request.app.state.router
    body = await read_body(request)
    authorization = request.headers.get("authorization", "")
    route = await router.choose(path, _json_or_none(body), authorization, body_bytes=len(body))
    return await forward(router, request, route, path, body)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT_PATH)


async def completions(request: Request) -> Response:
    return await _generate(request, COMPLETIONS_PATH)


async def models(request: Request) -> Response:
    model = request.path_params.get("model")
    return await _pass(request, "/v1/models" if model is None else f"/v1/models/{model}")


async def _pass(request: Request, path: str, method: str = "GET") -> Response:
    """A request that any healthy replica answers (not counted as routed): a GET, or a POST whose
    body goes along (the tokenizer routes: every replica serves the same model)."""
    router: Router = request.app.state.router
    route = Route(router.any_replicas(), Decision((), "other", 0))
    body = await read_body(request) if method == "POST" else b""
    return await forward(router, request, route, path, body, method, count=False)


async def tokenize(request: Request) -> Response:
    return await _pass(request, request.url.path, "POST")


async def health(request: Request) -> Response:
    router: Router = request.app.state.router
    healthy = len(router.replicas.healthy())
    body = {"status": "ok" if healthy else "no_healthy_replica", "healthy_replicas": healthy}
    return JSONResponse(body, status_code=200 if healthy else 503)


async def prometheus_metrics(request: Request) -> Response:
    return Response(request.app.state.router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def state(request: Request) -> Response:
    return JSONResponse(request.app.state.router.state())


async def explain(request: Request) -> Response:
    """What ``choose`` decides for ``request`` (nothing is sent), with the block hashes per replica."""
    router: Router = request.app.state.router
    given = _json_or_none(await read_body(request))
    if not isinstance(given, dict) or given.get("endpoint") not in ("chat", "completions"):
        raise RouterError(
            400, 'send {"endpoint": "chat" | "completions", "request": {...}}', param="endpoint"
        )
    path = CHAT_PATH if given["endpoint"] == "chat" else COMPLETIONS_PATH
    authorization = request.headers.get("authorization", "")
    route = await router.choose(path, given.get("request"), authorization)
    hashes = await router.block_hashes(path, given.get("request"), authorization)
    return JSONResponse({**router.explain(route), **hashes})


async def _admin_url(request: Request) -> str:
    given = _json_or_none(await read_body(request))
    url = given.get("url") if isinstance(given, dict) else None
    if not isinstance(url, str):
        raise RouterError(400, 'send {"url": "http://host:port"}', param="url")
    return url


async def admin_replicas(request: Request) -> Response:
    """POST: add a replica (checked at once); DELETE: remove one."""
    router: Router = request.app.state.router
    url = await _admin_url(request)
    try:
        if request.method == "DELETE":
            if not router.replicas.remove(url):
                raise RouterError(404, f"no replica {url}", param="url", code="not_found")
            return JSONResponse({"object": "router.replica", "url": url, "deleted": True})
        replica = router.replicas.add(url)
    except ValueError as exc:
        raise RouterError(400, str(exc), param="url") from None
    await router.replicas.check(replica)  # up at once when it answers
    return JSONResponse({"object": "router.replica", "url": replica.url, "healthy": replica.healthy})


ROUTES = [
    Endpoint("/v1/chat/completions", keyed(chat_completions), methods=["POST"]),
    Endpoint("/v1/completions", keyed(completions), methods=["POST"]),
    Endpoint("/v1/models", keyed(models), methods=["GET"]),
    Endpoint("/v1/models/{model:path}", keyed(models), methods=["GET"]),
    Endpoint("/tokenize", keyed(tokenize), methods=["POST"]),
    Endpoint("/detokenize", keyed(tokenize), methods=["POST"]),
    Endpoint("/health", health, methods=["GET"]),
    Endpoint("/metrics", prometheus_metrics, methods=["GET"]),
    Endpoint("/router/state", state, methods=["GET"]),
    Endpoint("/router/explain", keyed(explain), methods=["POST"]),
    Endpoint("/admin/replicas", keyed(admin_replicas), methods=["POST", "DELETE"]),
    *page_routes(cluster=True),  # GET /dashboard: the cluster's live page (kvtier/server/dashboard.py)
]
