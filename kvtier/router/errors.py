"""The router's own errors, in OpenAI's JSON shape (the same body as ``kvtier.server.protocol.APIError``,
pinned by a test), without importing FastAPI: the router starts faster on plain Starlette."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

MAX_MESSAGE = 2000


class RouterError(Exception):
    """Answered as ``status`` with ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message[:MAX_MESSAGE]
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
