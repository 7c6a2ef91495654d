"""The remote tier's connection to a Redis or Valkey server (``RemoteStore``), and the store's
names and faults: block keys (``kvtier:v1:<hex>``), the kinds of a refused value, a compare-and-delete
of a bad value. Shared by the tier's bookkeeping and its block I/O (``tiers/remote.py``)."""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.stats import REMOTE_ERROR_KINDS as ERROR_KINDS
from kvtier.tiers.base import BlockKey
from kvtier.tiers.block_format import HEADER_NBYTES, ByteBuffer, CorruptBlock
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.redis_bulk import BulkReader

logger = logging.getLogger("kvtier.tiers.remote")
INSTANCE_CHECK_S = 1.0  # how often a lookup may ask the store whether it restarted (one INFO round trip)

KEY_PREFIX = b"kvtier:v1:"
URL_SCHEMES = ("redis", "rediss", "unix")

ANY_SIZE = (0, 1 << 62)

# Deletes a bad value only if the store still holds it (a replica may have rewritten it since): the
# same header bytes and a size within [ARGV[3], ARGV[4]] (an oversized value: still oversized).
_DELETE_IF_SAME = """
local size = redis.call('STRLEN', KEYS[1])
if size < tonumber(ARGV[3]) or size > tonumber(ARGV[4]) then
  return 0
end
if redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def redis_key(key: BlockKey) -> bytes:
    """The store's name of block ``key``: ``kvtier:v1:<hex>``."""
    return KEY_PREFIX + key.hex().encode("ascii")


def redacted(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:" if parts.username else ":"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}***@{netloc}"))


class RemoteMiss(Exception):
    """A load that found no usable value; ``kind`` is one of ``ERROR_KINDS``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class StoreUnavailable(Exception):
    """The breaker is open: the operation was skipped without touching the network."""


def corrupt_kind(exc: CorruptBlock) -> str:
    """``bad_mac``, ``foreign`` or ``corrupt`` for a value ``decode_block_value`` refused."""
    text = str(exc)
    if "MAC" in text or "unsigned" in text:
        return "bad_mac"
    if any(s in text for s in ("another model", "written as", "block shape", "another block", "KV group")):
        return "foreign"
    return "corrupt"


def _fault_kind(exc: BaseException) -> str | None:
    """``timeout`` or ``connect`` for an error that means the store is not answering, else None."""
    if isinstance(exc, redis.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, redis.ConnectionError | ConnectionError | OSError):
        return "connect"
    return None


class RemoteStore:
    """A Redis/Valkey server: bounded connection pools, a circuit breaker, error counts by kind.

    ``lookup_timeout_s`` bounds a lookup on the scheduler's thread (connect and reply); the worker's
    commands, which move megabytes, get ``io_timeout_s``. Nothing is retried in line: a failure opens
    the breaker and the background probe reconnects."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int = 86400,
        lookup_timeout_s: float = 1.0,
        io_timeout_s: float = 5.0,
        max_connections: int = 4,
    ) -> None:
        self.url = redacted(url)
        self.ttl_s = ttl_s
        self.lookup = self._client(url, lookup_timeout_s, max_connections=2)
        self.io = self._client(url, io_timeout_s, max_connections=max_connections)
        self.bulk = BulkReader(url, timeout_s=io_timeout_s, max_connections=max_connections)
        self.errors: Counter[str] = Counter({kind: 0 for kind in ERROR_KINDS})
        self._lock = threading.Lock()
        self.generation = 0  # bumped at each outage: what was known to be there may be gone
        self._run_id: str | None = None  # the server instance last seen (a new one started empty)
        self._instance_checked = 0.0  # time.monotonic() of the last check_instance round trip
        self._instance_checks = True  # off when the server refuses INFO (an ACL without it)
        self.breaker = CircuitBreaker(f"remote tier {self.url}", self._probe, on_open=self._outage)
        self.rejected_reason: str | None = None  # a refusal that retrying cannot fix (authentication)
        self._delete_if_same = self.io.register_script(_DELETE_IF_SAME)
        try:
            self._probe()
        except redis.AuthenticationError as exc:
            self.rejected_reason = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 (unreachable at start-up: run without it until it answers)
            self.failed(exc)

    @staticmethod
    def _client(url: str, timeout_s: float, *, max_connections: int) -> redis.Redis:
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,  # waiting for a free connection
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        return redis.Redis(connection_pool=pool)

    def _probe(self) -> None:
        self.lookup.ping()

    def check_instance(self, every_s: float | None = None) -> None:
        """Notice a store that restarted between two of our commands (nothing failed, yet it came back
        empty): at most every ``every_s`` (``INSTANCE_CHECK_S``), compare its ``run_id`` with the last
        one seen; a new one counts as an outage, so the keys known to be there are forgotten."""
        now = time.monotonic()
        every_s = INSTANCE_CHECK_S if every_s is None else every_s
        if not self._instance_checks or now - self._instance_checked < every_s:
            return
        self._instance_checked = now
        if not self.breaker.allow():
            return
        try:
            run_id = self.lookup.info("server").get("run_id")
        except redis.ResponseError as exc:
            self._instance_checks = False
            logger.info(
                "remote tier %s: INFO refused (%s): a restart is noticed at its next failure", self.url, exc
            )
            return
        except Exception as exc:  # noqa: BLE001 (a check never fails a request)
            self.failed(exc)
            return
        if self._run_id is not None and run_id != self._run_id:
            logger.warning("remote tier %s restarted (a new run_id): forgetting the blocks it held", self.url)
            with self._lock:
                self.generation += 1
        self._run_id = run_id

    def _outage(self) -> None:
        with self._lock:
            self.generation += 1
        self.bulk.close()  # idle sockets to a dead server would fail the first reads after recovery

    def count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.errors[kind] += n

    def error_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.errors)

    def failed(self, exc: BaseException) -> None:
        """A command failed: count it and, if the store is not answering, open the breaker."""
        kind = _fault_kind(exc)
        self.count(kind or "rejected")
        if kind is not None:
            self.breaker.record_failure(exc)

    def count_leading(self, names: Sequence[bytes]) -> int:
        """How many leading ``names`` exist, in one pipelined round trip (0 when not answering)."""
        if not names or not self.breaker.allow():
            return 0
        pipe = self.lookup.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        try:
            found = pipe.execute()
        except Exception as exc:  # noqa: BLE001 (a lookup never fails a request)
            self.failed(exc)
            return 0
        n = 0
        while n < len(found) and found[n]:
            n += 1
        return n

    def count_present(self, names: Sequence[bytes]) -> int | None:
        """How many of ``names`` exist, in one pipelined round trip, from any thread: it touches nothing
        of this object but its connection pool (None when the store does not answer)."""
        pipe = self.lookup.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        try:
            return sum(1 for found in pipe.execute() if found)
        except Exception:  # noqa: BLE001 (a look from a route; the engine's own calls count failures)
            return None

    def delete_if_same(self, name: bytes, value: ByteBuffer, sizes: tuple[int, int] = ANY_SIZE) -> None:
        """Delete ``name`` if it still holds a value starting with ``value``'s header whose size is
        within ``sizes`` (inclusive)."""
        head = bytes(memoryview(value)[:HEADER_NBYTES])
        try:
            self._delete_if_same(keys=[name], args=[head, len(head), *sizes])
        except Exception as exc:  # noqa: BLE001 (best effort)
            self.failed(exc)

    def close(self) -> None:
        self.breaker.close()
        for client in (self.lookup, self.io):
            client.connection_pool.disconnect()
        self.bulk.close()
