"""The router's HTTP API: the replicas' OpenAI API, passed through, plus its own state and admin routes.

::

    route                                          key (kvtier.router.auth)   what
    POST /v1/chat/completions  POST /v1/completions  client                     choose a replica
                                                                               (kvtier.router.core), forward
    GET  /v1/models  GET /v1/models/{id}           client                     forwarded to a healthy replica
    POST /tokenize   POST /detokenize              client                     forwarded to a healthy replica
    POST /v1/messages                              client (also x-api-key)    Anthropic's Messages API: routed
                                                                               as chat, errors in its shape
    POST /v1/messages/count_tokens                 client (also x-api-key)    forwarded to a healthy replica
    GET  /health                                   none                       200 while some replica is
                                                                               healthy, else 503
    GET  /metrics                                  metrics (or admin), if set the router's own metrics
    GET  /router/state                             client or admin            mode, policy, each replica
    POST /router/explain  {"endpoint": "chat"|"completions"|"messages"|"responses", "request": {...}}
                                                   client or admin            the decision and block
                                                                               hashes, without sending
    POST /admin/replicas {"url": ...}              admin (404 without         admit a replica (checked:
    DELETE /admin/replicas {"url": ...}              --admin-key)             same model) or remove one
    GET  /dashboard, /dashboard/static/{name}      none (no data in them)     the cluster page
    POST /v1/responses                             client                     OpenAI's Responses API: routed
                                                                               as chat
    POST /v1/responses/input_tokens                client                     forwarded to a healthy replica
    *    /v1/responses/{id}[/...]                  client                     to the replica that made it
                                                                               (its id names it), else any

Only these routes reach a replica, each to a fixed path: ``/v1/models/{id}`` takes a model id that
:func:`model_path` accepts (letters, digits, ``._:+@-``; no ``..``, no ``/``, no ``\\``, whatever the
encoding: the path is matched after percent-decoding) and quotes it again; anything else is a 404 here.
The client's ``Authorization`` header is passed on to the replica it is routed to (a replica given by
``--replica`` or admitted by an admin, never another); the router's own calls to the replicas
(``/v1/kv/...``) carry ``--api-key``. Errors are OpenAI's JSON shape, a failure of the router's own
included (500, never plain text): the replicas' own :class:`~kvtier.server.protocol.APIError`, the one
wire contract of both. A replica's own errors (400 for a bad body, 404 for an unknown model...) come
back to the client unchanged. Bodies are bounded and timed (:mod:`kvtier.router.body`).

Anthropic's ``/v1/messages`` is routed as chat is (its body mapped onto the same conversation and tools:
:mod:`kvtier.server.anthropic`, so the router hashes the prompt the replica will run). Its key may come as
``x-api-key``: the router checks it and passes it on as ``Authorization: Bearer`` (the one key header it
forwards; the replica's route takes both). The router's own errors on it are Anthropic's shape.

Plain Starlette, not FastAPI (whose import alone costs more than half a second): the router answers
within well under a second of starting; the wire contract (``kvtier.server.protocol``: the replica's
request models and errors, ~0.1 s, no torch) is the heaviest import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as Endpoint

from kvtier.router import disagg
from kvtier.router.auth import check_admin, check_client, check_metrics, check_reader, guarded
from kvtier.router.body import parse_json, read_body, read_json
from kvtier.router.core import NoReplica, Route, Router, RouterSettings
from kvtier.router.policy import Decision
from kvtier.router.prompt import CHAT_PATH, COMPLETIONS_PATH, MESSAGES_PATH, RESPONSES_PATH
from kvtier.router.proxy import forward
from kvtier.router.replicas import AdmissionRefused
from kvtier.server.anthropic_errors import anthropic_error, as_anthropic, authorization_of, presents_key
from kvtier.server.dashboard import page_routes
from kvtier.server.limits import RequestLimits
from kvtier.server.protocol import APIError, http_error, not_found, unauthorized

logger = logging.getLogger("kvtier.router")

# A model id as the replicas name them ("SmolLM2-135M-Instruct", "tiny.gguf", "llama3:8b"): starts with a
# letter or digit, so never "." or ".."; no "/", "\" or "%" (the path was percent-decoded already).
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+@-]{0,255}")


def create_app(settings: RouterSettings) -> Starlette:
    """The app; ``app.state.router`` is its :class:`Router` (started with the app's lifespan)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(10.0))
    handlers = {
        APIError: _api_error,
        HTTPException: _http_error,
        NoReplica: _no_replica,
        Exception: _internal_error,
    }
    body_limits = Middleware(
        RequestLimits, max_bytes=settings.max_request_bytes, body_timeout=settings.timeout_body
    )
    app = Starlette(
        routes=ROUTES,
        lifespan=_lifespan,
        exception_handlers=handlers,  # type: ignore[arg-type]
        middleware=[body_limits],
    )
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
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return http_error(exc).response()


async def _no_replica(request: Request, exc: Exception) -> Response:
    request.app.state.router.metrics.failures.labels("no_replica").inc()
    message = "no healthy replica to serve the request; retry later"
    headers = {"Retry-After": "1"}
    return APIError(503, message, type="server_error", code="no_healthy_replica", headers=headers).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug of the router's own: OpenAI's 500, not plain text (Starlette re-raises it: uvicorn logs it)."""
    return APIError(500, "the router failed on this request", type="server_error").response()


def model_path(model: str) -> str:
    """``/v1/models/<model>`` for a valid model id (quoted again); a 404 for anything else."""
    if not MODEL_ID.fullmatch(model):
        raise APIError(
            404, f"The model {model[:100]!r} does not exist", param="model", code="model_not_found"
        )
    return "/v1/models/" + quote(model, safe="")


# ---------------------------------------------------------------------------------------- routes
async def _generate(request: Request, path: str) -> Response:
    router: Router = request.app.state.router
    body = await read_body(request)
    given = parse_json(body)  # a bad or too deeply nested body: our 400, the replica never sees it
    authorization = request.headers.get("authorization", "")
    continues = isinstance(given, dict) and given.get("previous_response_id") is not None
    if disagg.active(router) and not continues:  # some replica computes prompts for the others
        return await disagg.route(router, request, path, body, given, authorization)
    route = await router.choose(path, given, authorization, body_bytes=len(body))
    return await forward(router, request, route, path, body)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT_PATH)


async def completions(request: Request) -> Response:
    return await _generate(request, COMPLETIONS_PATH)


async def models(request: Request) -> Response:
    return await _pass(request, "/v1/models")


async def model(request: Request) -> Response:
    return await _pass(request, model_path(request.path_params["model"]))


async def _pass(request: Request, path: str, method: str = "GET") -> Response:
    """A request that any healthy replica answers (not counted as routed): a GET, or a POST whose
    body goes along (the tokenizer routes: every replica serves the same model). ``path``: fixed."""
    router: Router = request.app.state.router
    route = Route(router.any_replicas(), Decision((), "other", 0))
    body = await read_body(request) if method == "POST" else b""
    return await forward(router, request, route, path, body, method, count=False)


async def tokenize(request: Request) -> Response:
    return await _pass(request, "/tokenize", "POST")


async def detokenize(request: Request) -> Response:
    return await _pass(request, "/detokenize", "POST")


async def health(request: Request) -> Response:
    router: Router = request.app.state.router
    healthy = len(router.replicas.healthy())
    body = {"status": "ok" if healthy else "no_healthy_replica", "healthy_replicas": healthy}
    return JSONResponse(body, status_code=200 if healthy else 503)


async def prometheus_metrics(request: Request) -> Response:
    return Response(request.app.state.router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def state(request: Request) -> Response:
    return JSONResponse(request.app.state.router.state())


EXPLAINED = {"chat": CHAT_PATH, "completions": COMPLETIONS_PATH, "messages": MESSAGES_PATH}
EXPLAINED["responses"] = RESPONSES_PATH


async def explain(request: Request) -> Response:
    """What ``choose`` decides for ``request`` (nothing is sent), with the block hashes per replica."""
    router: Router = request.app.state.router
    given = await read_json(request)
    if not isinstance(given, dict) or given.get("endpoint") not in EXPLAINED:
        endpoints = " | ".join(f'"{e}"' for e in EXPLAINED)
        raise APIError(400, f'send {{"endpoint": {endpoints}, "request": {{...}}}}', param="endpoint")
    path = EXPLAINED[given["endpoint"]]
    authorization = request.headers.get("authorization", "")
    route = await router.choose(path, given.get("request"), authorization)
    hashes = await router.block_hashes(path, given.get("request"), authorization)
    return JSONResponse({**router.explain(route), **hashes})


async def _admin_url(request: Request) -> str:
    given = await read_json(request)
    url = given.get("url") if isinstance(given, dict) else None
    if not isinstance(url, str):
        raise APIError(400, 'send {"url": "http://host:port"}', param="url")
    return url


async def admin_replicas(request: Request) -> Response:
    """POST: admit a replica (it must answer and serve the same model, kvtier.router.replicas.admit);
    DELETE: remove one."""
    router: Router = request.app.state.router
    url = await _admin_url(request)
    try:
        if request.method == "DELETE":
            if not router.replicas.remove(url):
                raise APIError(404, f"no replica {url}", param="url", code="not_found")
            return JSONResponse({"object": "router.replica", "url": url, "deleted": True})
        replica = await router.replicas.admit(url)
    except AdmissionRefused as refused:
        raise APIError(refused.status, str(refused), param="url", code=refused.code) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="url") from None
    return JSONResponse({"object": "router.replica", "url": replica.url, "healthy": replica.healthy})


def _anthropic_client(request: Request) -> Request:
    """A Messages API request past the client key (``Authorization: Bearer`` or ``x-api-key``; a 401
    otherwise), its key as its ``Authorization`` header: what the router hashes the tenant from and
    passes on to the replica."""
    keys = request.app.state.router.keys
    if keys.api is not None and not presents_key(request.headers, keys.api):
        raise unauthorized("API key")
    authorization = authorization_of(request.headers).encode("latin-1")
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"authorization"]
    headers += [(b"authorization", authorization)] if authorization else []
    return Request({**request.scope, "headers": headers}, request.receive)


async def _anthropic(request: Request, path: str) -> Response:
    """Anthropic's routes: ``/v1/messages`` routed as chat, ``count_tokens`` to any healthy replica; the
    router's own errors in Anthropic's shape (a replica's come back as it wrote them)."""
    try:
        client = _anthropic_client(request)
        if path == MESSAGES_PATH:
            return await _generate(client, MESSAGES_PATH)
        return await _pass(client, path, "POST")
    except APIError as exc:
        return as_anthropic(exc).response()
    except NoReplica:
        request.app.state.router.metrics.failures.labels("no_replica").inc()
        message = "no healthy replica to serve the request; retry later"
        return anthropic_error(503, message, {"Retry-After": "1"}).response()


async def messages(request: Request) -> Response:
    return await _anthropic(request, MESSAGES_PATH)


async def messages_count_tokens(request: Request) -> Response:
    return await _anthropic(request, MESSAGES_PATH + "/count_tokens")


async def responses(request: Request) -> Response:
    """OpenAI's Responses API: routed as chat is (the body mapped onto the same conversation and tools)."""
    return await _generate(request, RESPONSES_PATH)


async def responses_input_tokens(request: Request) -> Response:
    return await _pass(request, RESPONSES_PATH + "/input_tokens", "POST")


async def stored_response(request: Request) -> Response:
    """A stored response's route (``GET``/``DELETE /v1/responses/{id}``, ``.../input_items``): to the
    replica whose id it bears first (its store), then the others (a shared store answers there too)."""
    router: Router = request.app.state.router
    rest = request.path_params["rest"]
    replicas = router.stored_response_replicas(rest.split("/", 1)[0])
    route = Route(replicas, Decision((), "stored_response", 0))
    query = f"?{request.url.query}" if request.url.query else ""
    body = await read_body(request) if request.method == "POST" else b""
    return await forward(
        router, request, route, f"{RESPONSES_PATH}/{rest}{query}", body, request.method, count=False
    )


async def no_admin_route(request: Request) -> Response:
    """Any other ``/admin/...`` path or method: 404 (after the admin check: 404 too while it is off)."""
    raise not_found()


ROUTES = [
    Endpoint("/v1/chat/completions", guarded(check_client, chat_completions), methods=["POST"]),
    Endpoint("/v1/completions", guarded(check_client, completions), methods=["POST"]),
    Endpoint("/v1/models", guarded(check_client, models), methods=["GET"]),
    Endpoint("/v1/models/{model:path}", guarded(check_client, model), methods=["GET"]),
    Endpoint("/tokenize", guarded(check_client, tokenize), methods=["POST"]),
    Endpoint("/detokenize", guarded(check_client, detokenize), methods=["POST"]),
    Endpoint("/v1/messages", messages, methods=["POST"]),  # its key checked by _anthropic_client
    Endpoint("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
    Endpoint("/v1/responses", guarded(check_client, responses), methods=["POST"]),
    Endpoint("/v1/responses/input_tokens", guarded(check_client, responses_input_tokens), methods=["POST"]),
    Endpoint("/v1/responses/{rest:path}", guarded(check_client, stored_response), methods=ALL_METHODS),
    Endpoint("/health", health, methods=["GET"]),
    Endpoint("/metrics", guarded(check_metrics, prometheus_metrics), methods=["GET"]),
    Endpoint("/router/state", guarded(check_reader, state), methods=["GET"]),
    Endpoint("/router/explain", guarded(check_reader, explain), methods=["POST"]),
    Endpoint("/admin/replicas", guarded(check_admin, admin_replicas), methods=["POST", "DELETE"]),
    Endpoint("/admin/{rest:path}", guarded(check_admin, no_admin_route), methods=ALL_METHODS),  # no 405
    *page_routes(cluster=True),  # GET /dashboard: the page and its static files, no data in them
]
