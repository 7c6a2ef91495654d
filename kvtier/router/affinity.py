"""``prompt_cache_key`` affinity: which replica a key's requests went to (OpenAI's prompt caching hint).

A client that sends ``prompt_cache_key`` says "these requests share a prefix": an agent's steps, one
user's conversation. The router remembers where the key's last request went and prefers that replica
for the next (``policy.keep_affinity``: while it is not much busier than the best), so the key's
requests meet their cached prefix there, also before the replica's KV events announced its blocks (a
burst of a new agent's first steps) and when the router cannot tokenize. Keys are scoped by the
request's credentials (two tenants' equal keys are different keys), bounded (``max_keys``, least
recently used forgotten first) and forgotten ``ttl_s`` after their last use. Pure Python, no I/O.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

MAX_KEYS = 100_000
TTL_S = 3600.0


def cache_key(body: Any, authorization: str) -> bytes | None:
    """The request's scoped ``prompt_cache_key`` (None: it has none)."""
    key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    if not isinstance(key, str) or not key:
        return None
    return hashlib.sha256(f"{authorization}\0{key}".encode()).digest()


class Affinity:
    """Scoped key -> the replica URL its requests went to last."""

    def __init__(
        self, max_keys: int = MAX_KEYS, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_keys = max_keys
        self.ttl_s = ttl_s
        self.clock = clock
        self._where: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def get(self, key: bytes | None) -> str | None:
        """The replica ``key`` went to, if it was used within ``ttl_s``."""
        if key is None or key not in self._where:
            return None
        url, at = self._where[key]
        if self.clock() - at > self.ttl_s:
            del self._where[key]
            return None
        return url

    def put(self, key: bytes | None, url: str) -> None:
        if key is None:
            return
        self._where[key] = (url, self.clock())
        self._where.move_to_end(key)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)
