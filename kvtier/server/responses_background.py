"""Background responses (``background: true``): answered at once, run on the server's loop, read back by
polling ``GET /v1/responses/{id}`` and stopped by ``POST /v1/responses/{id}/cancel``, as OpenAI's::

    POST /v1/responses (background)  stored {"status": "queued"} ─► answered with it, at once (the store
                                     down: 503, nothing runs)
    the run                          stored "in_progress" at its first output ─► stored "completed" |
                                     "incomplete" (the answer, as a foreground one) | "failed" ("error":
                                     the engine's, e.g. shutting down) | "cancelled" (the output so far)
    POST .../cancel                  running here: aborted, stored cancelled and answered; finished or
                                     cancelled before: answered as stored (idempotent); a response made
                                     without background: 400
    GET /v1/responses/{id}           as stored; queued or in progress, made by this replica yet not running
                                     in it (the process restarted): failed

The answer is the same the client would have had in the foreground (the same formatter stores it). The
runs of one server are ``app.state.background`` (:class:`BackgroundRuns`); a replica behind a router gets
its cancels (the stored-response routes go to the replica that made the response).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from kvtier.outputs import RequestOutput
from kvtier.server.api_errors import bad_request
from kvtier.server.async_engine import RequestStream
from kvtier.server.error_handlers import unavailable
from kvtier.server.response_store import owner_tag, replica_tag

logger = logging.getLogger("kvtier.server.responses")
ACTIVE = ("queued", "in_progress")


class _Formatter(Protocol):
    """What a run needs of :class:`kvtier.server.responses_route.ResponsesFormatter`."""

    response_id: str

    def snapshot(self, status: str, out: RequestOutput | None = None) -> dict[str, Any]: ...
    async def response(self, finals: list[RequestOutput]) -> dict[str, Any]: ...
    async def keep(self, response: dict[str, Any]) -> dict[str, Any]: ...


class BackgroundRuns:
    """The background responses running in this server, by response id."""

    def __init__(self) -> None:
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._cancelled: dict[str, dict[str, Any]] = {}  # what a cancel stored, for the cancel to answer

    def __len__(self) -> int:
        return len(self._runs)

    def running(self, response_id: str) -> bool:
        return response_id in self._runs

    async def start(self, fmt: _Formatter, stream: RequestStream) -> dict[str, Any]:
        """Store the response queued, start its run; returns the queued response (the POST's answer)."""
        queued = await fmt.keep(fmt.snapshot("queued"))
        if not queued["store"]:  # nobody could read it back: not started
            stream.abort()
            raise unavailable(
                "the response store is unavailable: retry the background request", "store_unavailable"
            )
        task = asyncio.create_task(self._run(fmt, stream))
        self._runs[fmt.response_id] = task
        task.add_done_callback(lambda _: self._runs.pop(fmt.response_id, None))
        return queued

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

    async def _run(self, fmt: _Formatter, stream: RequestStream) -> None:
        last: RequestOutput | None = None
        try:
            async for out in stream:
                if last is None:
                    await fmt.keep(fmt.snapshot("in_progress", out))
                last = out
                if out.finished:
                    await fmt.response([out])  # stored by the formatter, as a foreground answer is
                    return
        except asyncio.CancelledError:
            stream.abort()
            self._cancelled[fmt.response_id] = await fmt.keep(fmt.snapshot("cancelled", last))
        except Exception as exc:  # the engine's error (shutting down, dead): the response failed
            stream.abort()
            logger.warning("background response %s failed: %s", fmt.response_id, exc)
            failed = fmt.snapshot("failed", last)
            await fmt.keep({**failed, "error": {"code": "server_error", "message": str(exc)}})


def check_cancellable(response: dict[str, Any]) -> None:
    """400 for a response made in the foreground (nothing to cancel: OpenAI's answer too)."""
    if not response.get("background"):
        raise bad_request("only a response created with background: true can be cancelled", "response_id")


def as_seen(response: dict[str, Any], runs: BackgroundRuns, replica_id: str | None) -> dict[str, Any]:
    """A stored response as ``GET`` answers it: one still queued or in progress that this replica made
    but does not run (its process restarted since) failed."""
    rid = response.get("id")
    if (
        not response.get("background")
        or response.get("status") not in ACTIVE
        or replica_id is None
        or not isinstance(rid, str)
        or runs.running(rid)
        or owner_tag(rid) != replica_tag(replica_id)
    ):
        return response
    message = "the server restarted before this background response finished; create it again"
    return {**response, "status": "failed", "error": {"code": "server_error", "message": message}}
