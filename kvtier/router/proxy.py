"""Passing one request through to a replica and its answer back, byte for byte.

::

    forward(route)   attempt 1 on route.replicas[0]
                       connection refused / reset before the status line, 500/502/503/504, or the
                       replica marked down (hung: its health checks time out) while we wait for it:
                       nothing reached the client yet -> attempt 2 on route.replicas[1] (once)
                     the status line came: stream the body back as it arrives (SSE chunk by chunk),
                     with the replica's status and headers (+ ``x-kvtier-replica``)

While the router waits for the replica's answer it watches the client: a client that leaves closes the
connection to the replica, which then aborts the request and frees its blocks (a non-streaming request
ends 499, as on the replica). Once streaming, Starlette cancels the relay when the client goes; the
relay's ``finally`` closes the upstream connection, shielded from that cancellation. A replica that
breaks mid-stream ends the client's stream with an OpenAI error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvtier.router.core import Route, Router
from kvtier.router.replicas import Replica
from kvtier.server.protocol import APIError

RETRY_STATUSES = frozenset({500, 502, 503, 504})
_REQUEST_HEADERS = ("authorization", "content-type", "accept")
_RESPONSE_HEADERS = ("content-type", "retry-after", "www-authenticate", "cache-control", "x-accel-buffering")
_TIMEOUT = httpx.Timeout(connect=2.0, read=None, write=30.0, pool=10.0)
REPLICA_HEADER = "x-kvtier-replica"


class RelayResponse(StreamingResponse):
    """A streamed answer from a replica; whatever happens, the upstream is closed and released."""

    def __init__(
        self,
        upstream: httpx.Response,
        release: Callable[[], None],
        headers: dict[str, str],
        first_token: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(_relay(upstream, first_token), status_code=upstream.status_code, headers=headers)
        self.upstream = upstream
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.release()


# a chat stream's first event, sent before the prefill ends (the replica writes compact JSON)
_ROLE_CHUNKS = (b'"role":"assistant"', b'"role": "assistant"')


def opens_chat(chunk: bytes) -> bool:
    """Whether ``chunk`` is a chat stream's role event (sent before the replica's prefill ends)."""
    return any(role in chunk for role in _ROLE_CHUNKS)


async def _relay(upstream: httpx.Response, first_token: Callable[[], None]) -> AsyncIterator[bytes]:
    """The replica's bytes as they come; ``first_token`` called at the first chunk that is not the
    chat role event (the replica's prefill is then done)."""
    try:
        async for chunk in upstream.aiter_raw():
            if not opens_chat(chunk):
                first_token()
            yield chunk
    except httpx.TransportError as exc:
        if "text/event-stream" in upstream.headers.get("content-type", ""):
            error = APIError(
                502, f"the replica broke off the stream: {type(exc).__name__}", type="server_error"
            )
            yield f"data: {json.dumps(error.body())}\n\n".encode()
            yield b"data: [DONE]\n\n"


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k in _REQUEST_HEADERS if (v := request.headers.get(k)) is not None}


T = TypeVar("T")


async def unless(
    work: Awaitable[T], *stops: Awaitable[object]
) -> tuple[asyncio.Future[T], list[asyncio.Future[object]]]:
    """Run ``work`` until it ends or one of ``stops`` does (``work`` is then cancelled), leaving no task
    behind (nor when the caller is cancelled); ``work``'s task (``cancelled()``: a stop came first) and
    the stops'."""
    task = asyncio.ensure_future(work)
    watches = [asyncio.ensure_future(stop) for stop in stops]
    try:
        await asyncio.wait({task, *watches}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watch in watches:
            watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, *watches, return_exceptions=True)
    return task, watches


async def _send(router: Router, request: Request, replica: Replica, method: str, path: str, body: bytes):  # noqa: ANN202
    """The replica's response (its status line and headers read), or None when the client left first.
    Raises httpx.TransportError when the replica could not be reached or broke off before answering."""
    upstream = router.client.build_request(
        method, replica.url + path, content=body, headers=_headers(request), timeout=_TIMEOUT
    )
    sending = router.client.send(upstream, stream=True)
    send, (watch, _) = await unless(sending, until_disconnected(request), replica.down.wait())
    if send.cancelled():  # the client left, or the replica was marked down
        if watch.done() and not watch.cancelled():
            return None
        # a hung replica (its health checks timed out): nothing reached the client, so try the next
        raise httpx.ReadTimeout(f"{replica.url} was marked down before it answered", request=upstream)
    return send.result()


class Hold:
    """One request's share of a replica's load: in flight until released, its prefill work queued
    until its first token (or the release, whichever comes first). Each is given back once."""

    def __init__(self, replica: Replica, work: int) -> None:
        self.replica, self.work = replica, work
        self.prefilling = self.open = True
        replica.in_flight += 1
        replica.pending_prefill += work

    def first_token(self) -> None:
        if self.prefilling:
            self.prefilling = False
            self.replica.pending_prefill -= self.work

    def release(self) -> None:
        self.first_token()
        if self.open:
            self.open = False
            self.replica.in_flight -= 1


async def attempt(
    router: Router,
    request: Request,
    replica: Replica,
    path: str,
    body: bytes,
    *,
    last: bool,
    method: str = "POST",
    work: int = 0,
) -> Response | None:
    """One try on ``replica``: its answer, or None to try the next replica (when not ``last``).
    ``work``: the request's estimated prefill tokens there, queued on it until its first token."""
    hold = Hold(replica, work)
    release, first_token = hold.release, hold.first_token
    try:
        upstream = await _send(router, request, replica, method, path, body)
    except httpx.TransportError as exc:
        release()
        # refused or reset: down now; merely slow (a timeout): the health check decides
        if not isinstance(exc, httpx.TimeoutException):
            router.replicas.mark_down(replica, f"{type(exc).__name__} on {path}")
        return None
    except BaseException:
        release()
        raise
    if upstream is None:  # the client left before the replica answered
        release()
        return Response(status_code=499)
    if upstream.status_code in RETRY_STATUSES and not last:
        await upstream.aclose()
        release()
        return None
    headers = {k: v for k in _RESPONSE_HEADERS if (v := upstream.headers.get(k)) is not None}
    headers[REPLICA_HEADER] = replica.url
    if "text/event-stream" in upstream.headers.get("content-type", ""):
        return RelayResponse(upstream, release, headers, first_token)
    try:
        content = await upstream.aread()
    except httpx.TransportError:
        content = None
    finally:
        with contextlib.suppress(Exception):
            await upstream.aclose()
        release()
    if content is None:
        return (
            None
            if not last
            else APIError(502, "the replica broke off its answer", type="server_error").response()
        )
    return Response(content, status_code=upstream.status_code, headers=headers)


async def forward(
    router: Router,
    request: Request,
    route: Route,
    path: str,
    body: bytes,
    method: str = "POST",
    *,
    count: bool = True,
) -> Response:
    """Send to the route's best replica; once more to the next on a failure before the first byte.
    ``count``: a completion, counted in ``requests_routed`` by reason."""
    tries = route.replicas[:2]
    for i, replica in enumerate(tries):
        reason = route.decision.reason if i == 0 else "retry"
        if count:
            replica.routed[reason] += 1
            router.metrics.routed.labels(replica.url, reason).inc()
        work = route.work[i] if i < len(route.work) else 0
        last = i == len(tries) - 1
        answer = await attempt(router, request, replica, path, body, last=last, method=method, work=work)
        if answer is not None:
            return answer
    router.metrics.failures.labels("upstream").inc()
    urls = ", ".join(r.url for r in tries)
    return APIError(
        502,
        f"no replica answered ({urls}); retry later",
        type="server_error",
        code="upstream_unavailable",
        headers={"Retry-After": "1"},
    ).response()
