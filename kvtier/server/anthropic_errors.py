"""Anthropic's errors and keys, the wire edge that ``kvtier serve`` and ``kvtier router`` share (no torch,
no FastAPI).

Errors (:func:`as_anthropic`: the OpenAI routes' :class:`~kvtier.server.protocol.APIError` translated)::

    kvtier's                                         Anthropic's
    400 (invalid_request_error)                      400 invalid_request_error
    401 (a missing or wrong key)                     401 authentication_error
    404 (an unknown model or route)                  404 not_found_error
    408, 413 (the body too slow, too big)            408 timeout_error, 413 request_too_large
    503 queue_full, queue_wait, kv_capacity          529 overloaded_error (Retry-After kept)
    503 loading, draining; 500                       503, 500 api_error

The key: Anthropic's SDK sends ``x-api-key``; ``Authorization: Bearer`` works as on the OpenAI routes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.server.protocol import APIError, bearer, presents

# ------------------------------------------------------------------------------------------- errors
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for overloaded_error
OVERLOADED_CODES = frozenset({"queue_full", "queue_wait", "kv_capacity"})  # kvtier's 503s that are load
# The OpenAI tool fields kvtier.tools names, and Anthropic's names for them.
_RENAMES = (
    (".function.parameters", ".input_schema"),
    (".function.name", ".name"),
    (".function.description", ".description"),
    (".function", ""),
)


class AnthropicError(APIError):
    """An error answered with Anthropic's body: ``{"type": "error", "error": {"type", "message"}}``
    (``param`` and ``code`` stay on the object, for logs and tests, not on the wire)."""

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> AnthropicError:
    return AnthropicError(status, message, type=error_type(status), headers=headers)


def invalid(message: str, param: str | None = None) -> AnthropicError:
    """A 400 ``invalid_request_error``; ``param`` names the field (Anthropic's path, e.g.
    ``messages[0].content[1]``)."""
    return AnthropicError(400, message, type="invalid_request_error", param=param, code="invalid_request")


def renamed(text: str) -> str:
    for old, new in _RENAMES:
        text = text.replace(old, new)
    return text


def as_anthropic(exc: APIError) -> AnthropicError:
    """An OpenAI-shaped error of kvtier's as Anthropic's (the table above)."""
    if isinstance(exc, AnthropicError):
        return exc
    status = OVERLOADED if exc.status == 503 and exc.code in OVERLOADED_CODES else exc.status
    message = renamed(exc.message)
    if status == 401:
        message = (
            "invalid x-api-key: send the server's --api-key as 'x-api-key: <key>' or "
            "'Authorization: Bearer <key>'"
        )
    param = renamed(exc.param) if exc.param else None
    return AnthropicError(
        status, message, type=error_type(status), param=param, code=exc.code, headers=exc.headers
    )


# --------------------------------------------------------------------------------------------- keys
def authorization_of(headers: Mapping[str, str]) -> str:
    """The client's key as an ``Authorization`` value: ``Bearer <x-api-key>`` when Anthropic's header is
    there, else the ``Authorization`` header (what the tenant's salt is derived from, and what the router
    passes on to a replica)."""
    key = headers.get("x-api-key")
    if key:
        return f"Bearer {key.strip()}"
    return headers.get("authorization", "")


def presents_key(headers: Mapping[str, str], *keys: str | None) -> bool:
    """Whether ``Authorization: Bearer`` or ``x-api-key`` carries one of ``keys`` (constant time)."""
    authorization = headers.get("authorization", "")
    if bearer(authorization) is not None and presents(authorization, *keys):
        return True
    key = headers.get("x-api-key")
    return bool(key) and presents(f"Bearer {key}", *keys)
