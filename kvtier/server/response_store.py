"""Stored responses of OpenAI's Responses API: what ``previous_response_id`` continues and
``GET``/``DELETE /v1/responses/{id}`` read.

A stored response is kept with the input it ran on, whole (the earlier responses' input and output
items included), so the next turn's conversation is that input, that response's output items and the
new input, without walking a chain::

    StoredResponse   owner      a hash of the credentials that made it (another key's request: 404)
                     input      the input items it ran on, each with an id (input_items lists them)
                     response   the response object, as it was answered

    MemoryResponses  one replica's: the ``max_entries`` most recently stored, at most ``max_bytes`` of
                     them (their JSON), each for ``ttl_s``
    RedisResponses   in the Redis every replica of a deployment shares (``--kv-remote-url``): any
                     replica continues any response, as kvtier shares KV through the same store;
                     ``kvtier:resp:v1:<id>``, expiring after ``ttl_s``; signed (HMAC-SHA256) with the
                     remote tier's secret when it has one, so a forged or corrupt value is a miss

A response id names the replica that made it (``resp_<replica tag><random>``), so a router sends the
next turn where its conversation's KV is (:func:`owner_tag`). Torch-free; the Redis calls block (the
route runs them on its thread pool).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.config import ConfigError

MAX_ENTRIES = 10_000  # MemoryResponses: the most recently stored kept...
MAX_BYTES = 256 * 2**20  # ...within this much of their JSON (an agent's conversation can be long)
TTL_S = 30 * 24 * 3600  # OpenAI keeps a stored response 30 days
REDIS_PREFIX = b"kvtier:resp:v1:"
_TAG_HEX = 8  # a replica tag's hex digits in a response id
_RANDOM_HEX = 32
_ITEM_RANDOM_HEX = 8  # an item id's own random digits, after its response's


def replica_tag(replica_id: str) -> str:
    """The ``_TAG_HEX`` hex digits that name ``replica_id`` in its response ids."""
    return hashlib.sha256(replica_id.encode()).hexdigest()[:_TAG_HEX]


def new_response_id(replica_id: str | None) -> str:
    """``resp_<tag><random>`` (an unknown replica: a tag of zeros)."""
    tag = replica_tag(replica_id) if replica_id else "0" * _TAG_HEX
    return f"resp_{tag}{secrets.token_hex(_RANDOM_HEX // 2)}"


def owner_tag(response_id: Any) -> str | None:
    """The replica tag in a kvtier response id, or None (not one)."""
    if not isinstance(response_id, str) or not response_id.startswith("resp_"):
        return None
    rest = response_id[5:]
    if len(rest) != _TAG_HEX + _RANDOM_HEX or not _is_hex(rest):
        return None
    return rest[:_TAG_HEX]


def new_item_id(prefix: str, response_id: str | None = None) -> str:
    """``<prefix>_<hex>``: an item's id. In a kvtier response (``response_id``) it names that response
    (``<prefix>_<its tag and random><random>``), so an ``item_reference`` to it finds the stored response
    that holds it (:func:`response_of_item`)."""
    if owner_tag(response_id) is None:
        return f"{prefix}_{secrets.token_hex(12)}"
    assert response_id is not None
    return f"{prefix}_{response_id[5:]}{secrets.token_hex(_ITEM_RANDOM_HEX // 2)}"


def response_of_item(item_id: Any) -> str | None:
    """The stored response an item id names (:func:`new_item_id`), or None (not one of these)."""
    if not isinstance(item_id, str):
        return None
    _, sep, rest = item_id.partition("_")
    if not sep or len(rest) != _TAG_HEX + _RANDOM_HEX + _ITEM_RANDOM_HEX:
        return None
    response_id = "resp_" + rest[: _TAG_HEX + _RANDOM_HEX]
    return response_id if owner_tag(response_id) is not None and _is_hex(rest) else None


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def owner_of(authorization: str) -> str:
    """Who may read a stored response: a hash of the credentials that stored it."""
    return hashlib.sha256(f"kvtier-response\0{authorization}".encode()).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    input: list[dict[str, Any]]  # the input items it ran on, the earlier turns' included, each with an id
    response: dict[str, Any]  # the response object as answered

    def conversation(self) -> list[dict[str, Any]]:
        """The items a ``previous_response_id`` continuing it starts with: its input, then its output."""
        return [*self.input, *self.response.get("output", [])]

    def to_json(self) -> bytes:
        return json.dumps(
            {"owner": self.owner, "input": self.input, "response": self.response}, ensure_ascii=False
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StoredResponse | None:
        """The stored value, or None when it is not one (a corrupt value is a miss)."""
        try:
            value = json.loads(raw)
            return cls(str(value["owner"]), list(value["input"]), dict(value["response"]))
        except (ValueError, KeyError, TypeError):
            return None


class ResponseStore(Protocol):
    """Where stored responses are kept. ``get`` returns None for an id it does not hold (or a corrupt
    value); every method may raise ``StoreUnavailable``."""

    def get(self, response_id: str) -> StoredResponse | None: ...

    def put(self, response_id: str, stored: StoredResponse) -> None: ...

    def delete(self, response_id: str) -> bool: ...


class StoreUnavailable(RuntimeError):
    """The store did not answer (Redis down): the request is a 503, its answer is not stored."""


class MemoryResponses:
    """One replica's stored responses: the ``max_entries`` most recently stored within ``max_bytes``,
    each ``ttl_s``."""

    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.max_entries, self.ttl_s, self.clock, self.max_bytes = max_entries, ttl_s, clock, max_bytes
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[StoredResponse, float, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            kept = self._kept.get(response_id)
            if kept is None:
                return None
            if self.clock() - kept[1] > self.ttl_s:
                self._drop(response_id)
                return None
            return kept[0]

    def put(self, response_id: str, stored: StoredResponse) -> None:
        size = len(stored.to_json())
        with self._lock:
            self._drop(response_id)
            self._kept[response_id] = (stored, self.clock(), size)
            self.nbytes += size
            while self._kept and (len(self._kept) > self.max_entries or self.nbytes > self.max_bytes):
                self._drop(next(iter(self._kept)))  # the least recently stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self.nbytes -= kept[2]
        return kept is not None


class RedisResponses:
    """Stored responses in the deployment's Redis (shared by every replica that names it)."""

    def __init__(
        self, url: str, secret: str | None = None, ttl_s: int = TTL_S, timeout_s: float = 2.0
    ) -> None:
        import redis  # a dependency; imported here so that the module loads without it

        self.ttl_s = ttl_s
        self._secret = secret.encode() if secret else None
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise StoreUnavailable(
                f"the response store (Redis) did not answer: {type(exc).__name__}"
            ) from None

    def _signature(self, response_id: str, value: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, response_id.encode() + b"\0" + value, hashlib.sha256).digest()

    def _opened(self, response_id: str, raw: bytes) -> StoredResponse | None:
        if self._secret is not None:
            signature, raw = raw[:32], raw[32:]
            if not hmac.compare_digest(signature, self._signature(response_id, raw)):
                return None
        return StoredResponse.from_json(raw)

    def get(self, response_id: str) -> StoredResponse | None:
        raw = self._call(self._client.get, REDIS_PREFIX + response_id.encode())
        stored = self._opened(response_id, raw) if raw is not None else None
        if raw is not None and stored is None:  # corrupt or forged: a miss, and gone
            self._call(self._client.delete, REDIS_PREFIX + response_id.encode())
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        value = stored.to_json()
        if self._secret is not None:
            value = self._signature(response_id, value) + value
        self._call(self._client.set, REDIS_PREFIX + response_id.encode(), value, ex=self.ttl_s)

    def delete(self, response_id: str) -> bool:
        return bool(self._call(self._client.delete, REDIS_PREFIX + response_id.encode()))


RESPONSE_STORES = ("memory", "redis", "off")


def open_response_store(
    kind: str, url: str | None, max_entries: int = MAX_ENTRIES, secret: str | None = None
) -> ResponseStore | None:
    """The store ``--response-store`` names (None: off); ConfigError for a kind it is not, or redis
    without a URL."""
    if kind == "off":
        return None
    if kind == "memory":
        return MemoryResponses(max_entries)
    if kind == "redis":
        if not url:
            raise ConfigError("--response-store redis needs a Redis URL (--kv-remote-url)")
        return RedisResponses(url, secret)
    raise ConfigError(f"--response-store must be one of {', '.join(RESPONSE_STORES)}, got {kind!r}")
