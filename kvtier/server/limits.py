"""Limits on what one connection may cost the server: body size, and the time to send headers and body.

::

    connection opened ─► request line + headers ─► body ─────────────► the app
                         ├ --timeout-header: closed    ├ --max-request-bytes: 413 (Content-Length
                         │ (TimedH11Protocol)          │   at once, else counted as chunks arrive)
                         │                             └ --timeout-body: 408 (RequestLimits)
    after a response: idle for --timeout-keep-alive ─► closed (uvicorn)

:class:`RequestLimits` is an ASGI middleware: it reads the body itself, chunk by chunk, refusing it as
soon as it is too big or too slow, and replays it to the app (which would have buffered it whole anyway);
after the body, the app's ``receive`` is the server's again (so a client that leaves is seen).
:class:`TimedH11Protocol` is uvicorn's h11 protocol with a timer from the first byte of a request (or the
connection's opening) to the end of its headers: uvicorn itself never times out a connection that has
not finished a first request.

Admission by KV capacity and by queue wait is the engine's decision (``kvtier/scheduler/admission.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvtier.server.anthropic_errors import as_anthropic
from kvtier.server.protocol import APIError

Scope = dict[str, Any]
Message = dict[str, Any]


class _Refused(Exception):
    def __init__(self, error: APIError):
        self.error = error


MESSAGES_PREFIX = "/v1/messages"  # Anthropic's routes: their errors in Anthropic's shape


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def too_large(num_bytes: int | None, max_bytes: int) -> APIError:
    size = f"{num_bytes} bytes" if num_bytes is not None else "more bytes"
    return APIError(
        413,
        f"the request body has {size}; the limit is {max_bytes} bytes (--max-request-bytes)",
        code="request_too_large",
    )


async def send_error(send: Any, error: APIError, scope: Scope | None = None) -> None:
    """Answer ``error`` in OpenAI's shape (Anthropic's on ``/v1/messages``: the path of ``scope``) and
    close the connection (the unread body is never read)."""
    if scope is not None and str(scope.get("path", "")).startswith(MESSAGES_PREFIX):
        error = as_anthropic(error)
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestLimits:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 and one that takes longer than
    ``body_timeout`` seconds to arrive a 408, both decided before the body has been read in full."""

    def __init__(self, app: Any, max_bytes: int, body_timeout: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await send_error(send, too_large(length, self.max_bytes), scope)
            return
        try:
            body = await self._read_body(receive)
        except _Refused as refused:
            await send_error(send, refused.error, scope)
            return
        if body is None:
            return  # the client left before sending its body: nobody to answer
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body (None if the client disconnected); ``_Refused`` when too big or too slow."""
        chunks: list[bytes] = []
        size = 0
        deadline = None if self.body_timeout is None else time.monotonic() + self.body_timeout
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                message = await asyncio.wait_for(receive(), remaining)
            except TimeoutError:
                raise _Refused(
                    APIError(
                        408,
                        f"the request body did not arrive within {self.body_timeout:g} s (--timeout-body)",
                        code="request_timeout",
                    )
                ) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _Refused(too_large(None, self.max_bytes))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request line and headers take longer than
    ``header_timeout`` seconds (counted from the connection's opening, then from each request's first
    byte). Make one with :func:`timed_h11_protocol`."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._header_timer is None:
                self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def timed_h11_protocol(header_timeout: float) -> type[TimedH11Protocol]:
    """A :class:`TimedH11Protocol` class with this header timeout (uvicorn's ``http=`` takes a class)."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout})
