"""How ``kvtier serve`` answers what goes wrong: every exception a route raises becomes OpenAI's error
shape (Anthropic's routes translate their own, :mod:`.messages`).

::

    APIError                 its status and body (a 400 counted as a rejected request)
    RequestValidationError   a 400 naming the field (a body that is not JSON: 415's message, as a 400)
    HTTPException            Starlette's (404 route, 405 method) in OpenAI's shape
    EngineNotReady           503 model_not_ready (loading), or server_shutting_down (ShuttingDown)
    anything else            500 "internal error: <type>" (the traceback is logged, never sent)
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.server import bodies
from kvtier.server.api_errors import APIError, http_error, validation_error
from kvtier.server.async_engine import EngineNotReady

RETRY_AFTER_S = 1  # what a 503 asks a client to wait


class ShuttingDown(EngineNotReady):
    """The server is draining (SIGTERM): no new requests; the unfinished ones are ended with this."""


def unavailable(message: str, code: str) -> APIError:
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return APIError(503, message, type="server_error", code=code, headers=headers)


def not_ready_error(exc: EngineNotReady) -> APIError:
    code = "server_shutting_down" if isinstance(exc, ShuttingDown) else "model_not_ready"
    return unavailable(str(exc), code)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    if exc.status == 400:
        request.app.state.metrics.reject("invalid_request")
    return exc.response()


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    request.app.state.metrics.reject("invalid_request")
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and not bodies.is_json(content_type):
        return bodies.content_type_error(content_type).response()
    return validation_error(list(exc.errors())).response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return http_error(exc).response()


async def _not_ready(request: Request, exc: EngineNotReady) -> JSONResponse:
    return not_ready_error(exc).response()


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    """Anything unexpected: OpenAI's shape, not a plain-text 500 (the traceback is still logged)."""
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineNotReady, _not_ready)
    app.add_exception_handler(Exception, _internal)
