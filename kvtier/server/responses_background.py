"""Background responses (``background: true``): answered at once, run on the server's loop, read back by
polling ``GET /v1/responses/{id}`` and stopped by ``POST /v1/responses/{id}/cancel``, as OpenAI's::

    POST /v1/responses (background)  stored {"status": "queued"} ─► answered with it, at once (the store
                                     down: 503, nothing runs); with stream: its events, as a foreground
                                     stream's, kept (``EventLog``): the client may leave and follow them
                                     again (GET ...?stream=true&starting_after=N)
    the run                          stored "in_progress" at its first output ─► stored "completed" |
                                     "incomplete" (the answer, as a foreground one) | "failed" ("error":
                                     the engine's, e.g. shutting down) | "cancelled" (the output so far)
    POST .../cancel                  running here: aborted, stored cancelled and answered; finished or
                                     cancelled before: answered as stored (idempotent); a response made
                                     without background: 400
    GET /v1/responses/{id}           as stored; queued or in progress, made by this replica yet not running
                                     in it (the process restarted), or its lease run out (stored with
                                     ``kvtier.lease_until``, renewed while it runs: its replica went
                                     down): failed

The answer is the same the client would have had in the foreground (the same formatter stores it). The
runs of one server are ``app.state.background`` (:class:`BackgroundRuns`); a replica behind a router gets
its cancels (the stored-response routes go to the replica that made the response).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi.responses import StreamingResponse

from kvtier.outputs import RequestOutput
from kvtier.server.api_errors import bad_request
from kvtier.server.async_engine import RequestStream
from kvtier.server.error_handlers import unavailable
from kvtier.server.response_store import owner_tag, replica_tag

logger = logging.getLogger("kvtier.server.responses")
ACTIVE = ("queued", "in_progress")
LEASE_S = 60.0  # a running response's stored copy is renewed every third of it (kvtier.lease_until)
MAX_LOGS = 256  # streamed background responses whose events are kept after their end


class _Formatter(Protocol):
    """What a run needs of :class:`kvtier.server.responses_route.ResponsesFormatter`."""

    response_id: str

    def snapshot(self, status: str, out: RequestOutput | None = None) -> dict[str, Any]: ...
    async def response(self, finals: list[RequestOutput]) -> dict[str, Any]: ...
    async def keep(self, response: dict[str, Any]) -> dict[str, Any]: ...
    def stream(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int
    ) -> AsyncIterator[str]: ...


class EventLog:
    """A streamed background response's events, kept so that a client can follow them from any point
    (``GET /v1/responses/{id}?stream=true&starting_after=N``): entry ``i`` is sequence number ``i``."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.closed = False
        self._grew = asyncio.Event()

    def append(self, chunk: str) -> None:
        self.events.append(chunk)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()

    async def follow(self, start: int = 0) -> AsyncIterator[str]:
        """The events from ``start`` on, as they come, until the run ends."""
        i = start
        while True:
            grew = self._grew
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.closed:
                return
            await grew.wait()


@dataclass
class _Run:
    """One background response's run: its outputs (the first stores it in progress), the last of them and
    the engine's error, if it ended with one."""

    fmt: _Formatter
    stream: RequestStream
    log: EventLog | None  # streamed: its events
    last: RequestOutput | None = None
    error: Exception | None = None
    beat: asyncio.Task[None] | None = None  # renews the stored copy's lease while the run lives
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            async for out in self.stream:
                first, self.last = self.last is None, out
                if out.finished:
                    await self.stop_beat()  # its last write lands before the answer's
                elif first:
                    await keep_active(self.fmt, "in_progress", out)
                yield 0, out
        except Exception as exc:
            self.error = exc
            raise

    async def heartbeat(self) -> None:
        """Store the response again every third of ``LEASE_S`` (its lease renewed, its output so far)."""
        while not await _ended(self.ended, LEASE_S / 3):
            try:
                await keep_active(self.fmt, "queued" if self.last is None else "in_progress", self.last)
            except Exception:  # a store's own failures are logged by it; the run goes on regardless
                logger.exception("background response %s: lease not renewed", self.fmt.response_id)

    async def stop_beat(self) -> None:
        """No more lease renewals; returns once a write in flight has landed."""
        self.ended.set()
        if self.beat is not None:
            await self.beat

    async def answer(self) -> None:
        """The run to its end: the answer stored as a foreground one is (by the formatter)."""
        if self.log is None:
            async for _, out in self.outputs():
                if out.finished:
                    await self.fmt.response([out])
            return
        async for chunk in self.fmt.stream(self.outputs(), 1):  # an engine error: its event, then the end
            self.log.append(chunk)
        if self.error is not None:
            raise self.error


class BackgroundRuns:
    """The background responses running in this server, by response id, and the events of the streamed
    ones (the most recent ``MAX_LOGS`` kept after their end)."""

    def __init__(self) -> None:
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._cancelled: dict[str, dict[str, Any]] = {}  # what a cancel stored, for the cancel to answer
        self._logs: OrderedDict[str, EventLog] = OrderedDict()

    def running(self, response_id: str) -> bool:
        return response_id in self._runs

    def log(self, response_id: str) -> EventLog | None:
        """The events of a streamed background response made here (None: not one, or no longer kept)."""
        return self._logs.get(response_id)

    async def start(
        self, fmt: _Formatter, stream: RequestStream, streamed: bool
    ) -> dict[str, Any] | EventLog:
        """Store the response queued and start its run; returns the queued response (the POST's answer),
        or, ``streamed``, the run's events to follow."""
        queued = await keep_active(fmt, "queued")
        if not queued["store"]:  # nobody could read it back: not started
            stream.abort()
            raise unavailable(
                "the response store is unavailable: retry the background request", "store_unavailable"
            )
        log = EventLog() if streamed else None
        if log is not None:
            self._logs[fmt.response_id] = log
            while len(self._logs) > MAX_LOGS and (oldest := next(iter(self._logs))) not in self._runs:
                del self._logs[oldest]
        task = asyncio.create_task(self._run(_Run(fmt, stream, log)))
        self._runs[fmt.response_id] = task
        task.add_done_callback(lambda _: self._runs.pop(fmt.response_id, None))
        return queued if log is None else log

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        """Cancel the run of ``response_id`` here: the response as stored cancelled (None: none runs)."""
        task = self._runs.get(response_id)
        if task is None:
            return None
        task.cancel()
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():  # this request itself was cancelled (its client left)
                raise
        return self._cancelled.pop(response_id, None)

    async def _run(self, run: _Run) -> None:
        fmt = run.fmt
        run.beat = asyncio.create_task(run.heartbeat())
        try:
            await run.answer()
        except asyncio.CancelledError:
            run.stream.abort()
            await run.stop_beat()
            self._cancelled[fmt.response_id] = await fmt.keep(fmt.snapshot("cancelled", run.last))
        except Exception as exc:  # the engine's error (shutting down, dead): the response failed
            run.stream.abort()
            await run.stop_beat()
            logger.warning("background response %s failed: %s", fmt.response_id, exc)
            failed = fmt.snapshot("failed", run.last)
            await fmt.keep({**failed, "error": {"code": "server_error", "message": str(exc)}})
        finally:
            run.ended.set()
            if run.log is not None:
                run.log.close()


async def keep_active(fmt: _Formatter, status: str, out: RequestOutput | None = None) -> dict[str, Any]:
    """Store the response ``status`` (queued, in progress) with a lease: ``kvtier.lease_until``, when a
    reader may take it for lost unless renewed (its replica went down)."""
    lease = {"lease_until": round(time.time() + LEASE_S, 3)}
    return await fmt.keep({**fmt.snapshot(status, out), "kvtier": lease})


async def _ended(event: asyncio.Event, timeout: float) -> bool:
    """Whether ``event`` is set within ``timeout`` seconds."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True


def followed(log: EventLog, after: int = -1) -> StreamingResponse:
    """A streamed background response's events after sequence number ``after``, as they come (the run
    goes on if the client leaves)."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(log.follow(after + 1), media_type="text/event-stream", headers=headers)


def check_cancellable(response: dict[str, Any]) -> None:
    """400 for a response made in the foreground (nothing to cancel: OpenAI's answer too)."""
    if not response.get("background"):
        raise bad_request("only a response created with background: true can be cancelled", "response_id")


def as_seen(response: dict[str, Any], runs: BackgroundRuns, replica_id: str | None) -> dict[str, Any]:
    """A stored response as ``GET`` answers it: one still queued or in progress failed when its lease
    ran out (the replica running it went down) or when this replica made it but does not run it (its
    process restarted since)."""
    rid = response.get("id")
    if not response.get("background") or response.get("status") not in ACTIVE or not isinstance(rid, str):
        return response
    lease = (response.get("kvtier") or {}).get("lease_until")
    if isinstance(lease, (int, float)) and lease < time.time() and not runs.running(rid):
        message = "the replica running this background response went down before it finished; create it again"
    elif replica_id is not None and not runs.running(rid) and owner_tag(rid) == replica_tag(replica_id):
        message = "the server restarted before this background response finished; create it again"
    else:
        return response
    failed = {k: v for k, v in response.items() if k != "kvtier"}
    return {**failed, "status": "failed", "error": {"code": "server_error", "message": message}}
