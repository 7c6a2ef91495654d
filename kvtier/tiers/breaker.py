"""A circuit breaker for a store across the network: a dead store costs nothing per request.

::

    closed ──failure──► open ──probe succeeds (background thread, backoff 0.5 s → 10 s)──► closed
       ▲                  │
       └──────────────────┘  while open: ``allow()`` is False at once (no connect, no timeout)

The breaker never probes on the caller's thread: ``probe`` (a PING with a connect timeout) runs on a
daemon thread of its own while the breaker is open, retrying with exponential backoff. An outage is
logged once when it opens and once when it closes again, whatever the number of requests in between.
Thread-safe; torch-free.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kvtier.tiers.remote")


class BreakerState(enum.IntEnum):
    """The breaker's state; the value is the ``kvtier:remote_breaker_state`` gauge."""

    CLOSED = 0  # the store answers: use it
    OPEN = 1  # the store failed: every operation is skipped until a background probe succeeds


class CircuitBreaker:
    """Open after a failure, closed again by a successful background ``probe``.

    ``on_open`` and ``on_close`` run on the thread that caused the change (callbacks of the owner:
    forget what the store held, say so in the log)."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], None],
        *,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        on_open: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._probe = probe
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._on_open = on_open
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._closing = False
        self._prober: threading.Thread | None = None
        self.num_outages = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    def allow(self) -> bool:
        """Whether to use the store now (a plain read: a few nanoseconds)."""
        return self._state is BreakerState.CLOSED

    def record_failure(self, exc: BaseException) -> None:
        """The store failed to answer (refused, reset, timed out): open, log once, start probing."""
        with self._lock:
            if self._state is BreakerState.OPEN or self._closing:
                return
            self._state = BreakerState.OPEN
            self._opened_at = time.monotonic()
            self.num_outages += 1
            self._prober = threading.Thread(target=self._probe_loop, name="kvtier-remote-probe", daemon=True)
            self._prober.start()
        logger.warning(
            "%s is unreachable (%s: %s): lookups are misses and stores are dropped until it recovers",
            self.name,
            type(exc).__name__,
            " ".join(str(exc).split())[:200],
        )
        if self._on_open is not None:
            self._on_open()

    def _probe_loop(self) -> None:
        backoff = self.min_backoff_s
        while not self._wake.wait(backoff):
            try:
                self._probe()
            except Exception:  # noqa: BLE001 (any failure means: still down)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            with self._lock:
                if self._closing:
                    return
                self._state = BreakerState.CLOSED
                down_s = time.monotonic() - self._opened_at
            logger.warning("%s answers again after %.1f s: the remote tier is back in use", self.name, down_s)
            return

    def close(self) -> None:
        """Stop probing (the owner is shutting down)."""
        with self._lock:
            self._closing = True
        self._wake.set()
        if self._prober is not None:
            self._prober.join(timeout=5.0)
