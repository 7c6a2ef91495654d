"""Prompt-cache retention: the blocks clients asked kvtier to keep, until when, and how much each tier
protects.

A request may ask that its prompt's first N tokens stay cached for T seconds: Anthropic's
``cache_control`` breakpoints with their TTL (5 minutes or 1 hour), OpenAI's ``prompt_cache_retention``
(24 hours, the whole prompt). Each such ask is a :class:`RetentionSpan`. When the request's prompt has
been computed (every request's, hit or not: a hit refreshes), the keys of the full blocks before each
span's end are retained until now + T, or their later expiry::

    tokens     |--- system ---|--- tools ---|--- turn 1 ---|- turn 2 -|
    spans      ^ 1h                        ^ 5m                        (none)
    retained   blocks [0, 1h end) until now + 1h; [1h end, 5m end) until now + 5m

What a retained key is worth in each tier (while it has not expired):

    device pool   a retained cached block that falls idle waits in a queue of its own, taken after every
                  other free block: it is evicted last (``BlockPool``)
    host, disk    eviction passes over it (and moves it to the recently used end) while the tier
                  protects fewer keys than its cap (``protects``)

Caps: ``max_blocks`` keys are retained at once (``max_fraction`` of the largest tier, set by the engine);
an ask beyond it is served all the same and retains only what fits, in prefix order: usage reports the
tokens it retained. Each tier protects at most ``cap(its capacity)`` keys. Expired keys are forgotten
lazily. Tenants need nothing here: every key is chained from its tenant's salt (``--prefix-cache-scope``).

Times are wall-clock seconds (``time.time``): the disk tier writes a block's expiry into its header, so
retention outlives a restart. Pure Python, no torch.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.kv.groups import KVLayout
from kvtier.kv.hashing import BlockHash, group_key

MAX_TTL_S = 24 * 3600.0
WHOLE_PROMPT = 1 << 62  # a span's num_tokens covering any prompt


@dataclass(frozen=True)
class RetentionSpan:
    """Keep the prompt's first ``num_tokens`` tokens cached for ``ttl_s`` seconds from each use."""

    num_tokens: int
    ttl_s: float

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"a retention span needs num_tokens >= 0, got {self.num_tokens}")
        if not 0 < self.ttl_s <= MAX_TTL_S:
            raise ValueError(f"a retention span's ttl must be in (0, {MAX_TTL_S:.0f}] s, got {self.ttl_s}")


class Retention:
    """Retained keys and their expiry (wall-clock seconds)."""

    def __init__(
        self, max_blocks: int, max_fraction: float = 0.5, clock: Callable[[], float] = time.time
    ) -> None:
        if not 0.0 <= max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be in [0, 1], got {max_fraction}")
        self.max_blocks = max_blocks
        self.max_fraction = max_fraction
        self.clock = clock
        self._until: dict[BlockHash, float] = {}
        self.num_refused = 0  # keys an ask could not retain (the cap was reached)
        self._next_purge = float("-inf")

    def __len__(self) -> int:
        """Keys retained now (expired ones are dropped at most once a second: a per-step gauge)."""
        now = self.clock()
        if now >= self._next_purge:
            self._next_purge = now + 1.0
            self.purge()
        return len(self._until)

    def count_in(self, held: Collection[BlockHash]) -> int:
        """How many of ``held`` are retained now, walking the smaller of the two."""
        if not self._until:
            return 0
        now = self.clock()
        if len(self._until) <= len(held):
            return sum(1 for key, until in self._until.items() if until > now and key in held)
        return sum(1 for key in held if self._until.get(key, now) > now)

    def cap(self, capacity_blocks: int) -> int:
        """How many keys a tier of ``capacity_blocks`` protects at most."""
        return int(capacity_blocks * self.max_fraction)

    def retain(self, keys: Sequence[BlockHash], ttl_s: float) -> int:
        """Retain ``keys`` (in prefix order) for ``ttl_s`` from now; returns how many of them are now
        retained: a leading run (a key already retained is refreshed even at the cap)."""
        until = self.clock() + ttl_s
        for n, key in enumerate(keys):
            held = self._until.get(key)
            if held is None and len(self._until) >= self.max_blocks:
                self.purge()
                if len(self._until) >= self.max_blocks:
                    self.num_refused += len(keys) - n
                    return n
            self._until[key] = until if held is None else max(held, until)
        return len(keys)

    def until(self, key: BlockHash) -> float | None:
        """When ``key``'s retention expires; None if it is not retained (or has expired)."""
        expiry = self._until.get(key)
        if expiry is None:
            return None
        if expiry <= self.clock():
            del self._until[key]
            return None
        return expiry

    def peek(self, key: BlockHash) -> float | None:
        """``until`` without forgetting an expired key: safe from another thread (a Redis writer)."""
        expiry = self._until.get(key)
        return expiry if expiry is not None and expiry > self.clock() else None

    def ttl_at_least(self, key: BlockHash, ttl_s: int) -> int:
        """``ttl_s``, or ``key``'s remaining retention in whole seconds when that is longer (a Redis value's
        expiry, written or refreshed: never shorter than its retention; 0, no expiry, stays 0). Reads with
        ``peek``: safe from another thread."""
        until = self.peek(key) if ttl_s else None
        return ttl_s if until is None else max(ttl_s, math.ceil(until - self.clock()))

    def is_retained(self, key: BlockHash) -> bool:
        return self.until(key) is not None

    def restore(self, key: BlockHash, until: float) -> None:
        """Retention read back from a block's header (a restart): kept if it has not expired and fits."""
        if until > self.clock() and (key in self._until or len(self._until) < self.max_blocks):
            self._until[key] = max(until, self._until.get(key, until))

    def entries(self) -> dict[BlockHash, float]:
        """Every retained key and its expiry (what the disk tier writes down)."""
        self.purge()
        return dict(self._until)

    def purge(self) -> int:
        """Forget expired keys; returns how many."""
        now = self.clock()
        gone = [k for k, t in self._until.items() if t <= now]
        for k in gone:
            del self._until[k]
        return len(gone)


class TierProtection:
    """The keys one tier (host, disk) keeps from LRU eviction: retained ones, at most ``cap`` of them."""

    def __init__(self, retention: Retention | None, capacity_blocks: int) -> None:
        self.retention = retention
        self.cap = 0 if retention is None else retention.cap(capacity_blocks)
        self.keys: set[BlockHash] = set()
        self._counted_at, self._count = float("-inf"), 0

    def protects(self, key: BlockHash) -> bool:
        """Whether eviction must pass over ``key`` now (it takes one of the cap's places if it can)."""
        if self.retention is None:
            return False
        if not self.retention.is_retained(key):
            self.keys.discard(key)
            return False
        if key in self.keys:
            return True
        if len(self.keys) < self.cap:
            self.keys.add(key)
            return True
        return False

    def victim(self, held: OrderedDict[BlockHash, Any], pins: Counter[BlockHash]) -> BlockHash | None:
        """A tier's eviction victim: the least recently used ``held`` key neither pinned nor protected
        (None: none is); the protected keys passed over move to the recently used end."""
        walk = self.evictable(held, pins)
        found = next(walk, None)
        walk.close()
        return found

    def evictable(self, held: OrderedDict[BlockHash, Any], pins: Counter[BlockHash]) -> Generator[BlockHash]:
        """``victim`` over and over in one walk: the keys to evict, least recently used first, while the
        caller evicts none of them yet; closed, the protected keys passed over move to the recently used
        end (as ``victim`` moves them)."""
        guarded = self.retention is not None and len(self.retention) > 0
        if not guarded:
            self.keys.clear()  # nothing is retained: no key is protected
        passed: list[BlockHash] = []
        try:
            for key in held:
                if pins.get(key):
                    continue
                if guarded and self.protects(key):
                    passed.append(key)
                    continue
                yield key
        finally:
            for key in passed:
                held.move_to_end(key)

    def forget(self, key: BlockHash) -> None:
        """``key`` left the tier."""
        self.keys.discard(key)

    def count(self, held: Collection[BlockHash]) -> int:
        """How many of the tier's ``held`` keys are retained now (its retained blocks, for metrics):
        counted at most once a second (the engine's stats are taken every step)."""
        if self.retention is None:
            return 0
        now = self.retention.clock()
        if now >= self._counted_at + 1.0 or now < self._counted_at:
            self._counted_at, self._count = now, self.retention.count_in(held)
        return self._count


def retained_keys(
    block_hashes: Sequence[BlockHash], num_cached: int, layout: KVLayout, block_size: int, num_tokens: int
) -> list[BlockHash]:
    """The keys a hit on the first ``num_tokens`` tokens reads, by position: every group's key of the
    full blocks before ``num_tokens``, a sliding group's only from the block its window reaches back to
    (a hit ending there never reads an older one)."""
    n_full = min(num_tokens // block_size, num_cached, len(block_hashes))
    if layout.is_dense:
        return list(block_hashes[:n_full])
    firsts = [spec.first_reachable_block(n_full * block_size, block_size) for spec in layout.groups]
    return [
        group_key(block_hashes[i], g) for i in range(n_full) for g, first in enumerate(firsts) if i >= first
    ]


def retain_spans(
    retention: Retention,
    block_hashes: Sequence[BlockHash],
    num_cached: int,
    layout: KVLayout,
    block_size: int,
    spans: Sequence[RetentionSpan],
) -> int:
    """Retain each span's keys (``retained_keys``), shortest span first, for its TTL; returns the prompt
    tokens retained: the longest span accepted whole, or where the cap refused the rest of a dense
    model's span, the blocks it took (a hybrid prefix cut short holds no usable window)."""
    retained = 0
    for span in sorted(spans, key=lambda s: s.num_tokens):
        keys = retained_keys(block_hashes, num_cached, layout, block_size, span.num_tokens)
        num_kept = retention.retain(keys, span.ttl_s)
        if num_kept < len(keys):
            return max(retained, num_kept * block_size) if layout.is_dense else retained
        retained = min(span.num_tokens // block_size, num_cached) * block_size
    return retained
