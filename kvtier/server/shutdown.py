"""Graceful shutdown: SIGTERM drains the server, so a replica behind a router restarts without a failed
request.

::

    SIGTERM ─► draining: /health answers 503 {"status": "draining"}; new requests 503 (Retry-After)
            ─► the running requests finish, for up to --shutdown-timeout seconds
            ─► those still running end with OpenAI's 503 error (server_shutting_down): a JSON body,
               or an SSE error event and [DONE] for a stream; never a plain-text 500
            ─► uvicorn's own shutdown: the listener closes, each connection once its response is sent
    a second SIGINT (Ctrl-C twice): uvicorn stops at once

``DrainingServer`` is a ``uvicorn.Server`` whose first exit signal starts the drain instead of the stop;
the process then exits with status 0. ``request_drain()`` does the same from any thread (tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType
from typing import Any

import uvicorn

from kvtier.server.limits import timed_h11_protocol

logger = logging.getLogger("kvtier.server")


def uvicorn_config(
    app: Any,
    *,
    log_level: str = "warning",
    timeout_keep_alive: float = 5.0,
    timeout_header: float = 10.0,
) -> uvicorn.Config:
    """uvicorn's settings for kvtier: h11 with a header timeout, keep-alive timeout, a short final wait
    (the drain has already let the requests finish)."""
    return uvicorn.Config(
        app,
        http=timed_h11_protocol(timeout_header) if timeout_header > 0 else "h11",  # 0: no header timeout
        loop="asyncio",  # the one the server is tested on (uvloop, installed for the router, is not)
        log_level=log_level,
        timeout_keep_alive=max(1, round(timeout_keep_alive)),
        timeout_graceful_shutdown=5,
    )


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float = 30.0):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.drained = False  # set when the drain has ended (the server then stops)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: uvicorn's own (stop now)
            return
        self.request_drain()

    def request_drain(self) -> None:
        """Start the drain (idempotent; any thread)."""
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        from kvtier.server.error_handlers import ShuttingDown

        app = self.config.app  # the FastAPI app (uvicorn wraps it in config.loaded_app)
        app.state.draining = True
        engine = app.state.engine
        logger.warning(
            "kvtier: shutting down: draining %d running request(s), for up to %g s (--shutdown-timeout)",
            engine.num_active,
            self.shutdown_timeout,
        )
        deadline = time.monotonic() + self.shutdown_timeout
        while engine.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_active:
            logger.warning("kvtier: ending %d request(s) still running", engine.num_active)
            engine.abort_all(
                ShuttingDown(
                    f"the server is shutting down and the request did not finish within "
                    f"{self.shutdown_timeout:g} s (--shutdown-timeout); retry it"
                )
            )
        await asyncio.sleep(0.1)  # let the last responses be written
        self.drained = True
        self.should_exit = True
