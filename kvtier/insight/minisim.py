"""Miss-ratio curves of a lower tier by miniature simulation: the tier's own admission rules, replayed
at several sizes at once over a (spatially sampled) stream of its block keys.

Why not reuse distances: the host and disk tiers are not a plain LRU over one stream. A block enters
the host tier when the device evicts it (write-back) *unless the tier already holds it*, and then it is
not refreshed; a lookup refreshes only what the tier serves (a miss is recomputed on the device and
stored later, on its eviction); a block read up from disk is stored into the host tier. Whether a
store refreshes depends on whether the tier still holds the block, which depends on its size: the
policy has no stack property, so one reuse-distance histogram cannot give every size (near the knee of
a round-robin workload it was 12 points off). Instead each size in ``FACTORS`` runs its own small
LRU with the tier's rules (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", ATC'17)::

    offer(keys)            the tier above evicts/writes back: insert at MRU iff not held (no refresh)
    lookup(keys, promoted) blocks asked of the tier, in prompt order: a hit iff held and every
                           earlier block of the prompt hit (the chain); hits become MRU; blocks served
                           by a slower tier through this one (``promoted``) are inserted

Exact while the distinct keys seen stay within ``max_keys`` (every key simulated, rate 1). Beyond, the
fixed-size SHARDS rule: the sampling threshold drops to the largest tracked hash, those keys are
forgotten, and each simulated cache holds ``rate x size`` blocks; each sampled lookup weighs
``1 / rate``. Sizes between the simulated ones are interpolated. Deterministic (sampling depends only
on the keys). Torch-free.

Known bias when sampled: the chain rule only sees sampled parents, so a block whose unsampled parent
was evicted still counts as a hit; on a Zipf test stream the estimate was within 1 point at rate ~0.45,
within 1.3 at ~0.23, but 4-6 points high at ~0.11 (``tests/test_mrc_minisim.py``). Below ``max_keys``
distinct blocks (8192 per tier by default) there is no sampling and no bias.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Sequence, Set
from dataclasses import dataclass

from kvtier.insight.mrc import MODULUS, key_hash

# Simulated sizes, as factors of the tier's capacity (the advice's curve points and the steps between).
FACTORS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)

# A shrink frees this fraction of ``max_keys`` (1/32: the rate drops in steps of ~3%, not per key).
SHRINK_SLACK = 32


@dataclass(frozen=True)
class SimSnapshot:
    """The simulated hit weights at one moment (same reading interface as ``TrackerSnapshot``)."""

    sizes: tuple[float, ...]  # simulated capacities in blocks, ascending
    hits: tuple[float, ...]  # estimated lookups that hit, per size
    total: float  # estimated lookups
    num_lookups: int  # lookups seen (every block, sampled or not)
    num_sampled: int
    sampling_rate: float
    num_tracked: int

    def hit_ratio(self, capacity_blocks: float) -> float:
        """Estimated fraction of looked-up blocks the tier would serve with ``capacity_blocks``: the
        simulated size's, interpolated between sizes (and towards 0 below the smallest)."""
        if self.total <= 0 or not self.sizes:
            return 0.0
        ratios = [h / self.total for h in self.hits]
        i = bisect.bisect_left(self.sizes, capacity_blocks)
        if i < len(self.sizes) and self.sizes[i] == capacity_blocks:
            return ratios[i]
        if i >= len(self.sizes):
            return ratios[-1]
        lo_size, lo_ratio = (0.0, 0.0) if i == 0 else (self.sizes[i - 1], ratios[i - 1])
        t = (capacity_blocks - lo_size) / (self.sizes[i] - lo_size)
        return lo_ratio + t * (ratios[i] - lo_ratio)


class _MiniCache:
    """One simulated size: an LRU of sampled keys holding ``rate x size`` of them."""

    def __init__(self, size: float) -> None:
        self.size = size
        self.held: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0.0
        self.limit = round(size)  # blocks held at most: ``rate x size`` (``set_rate``)

    def set_rate(self, rate: float) -> None:
        """The sampling rate dropped: hold ``rate x size`` blocks, the least recently used go."""
        self.limit = max(0, round(self.size * rate))
        while len(self.held) > self.limit:
            self.held.popitem(last=False)

    def insert(self, key: bytes, pinned: Set[bytes] = frozenset()) -> bool:
        """Store ``key`` unless held, evicting the least recently used block that is not ``pinned``;
        False if every other block is pinned (the store is dropped)."""
        held = self.held
        if key in held:
            return False
        held[key] = None
        while len(held) > self.limit:
            victim = next(iter(held))  # the LRU end: pinned blocks sit at the MRU end, mostly
            if victim in pinned or victim == key:
                victim = next((k for k in held if k not in pinned and k != key), None)
                if victim is None:
                    del held[key]
                    return False
            del held[victim]
        return True

    def insert_all(self, keys: Sequence[bytes], pinned: set[bytes]) -> None:
        """One step's stores: blocks stored earlier in the step are reserved (not evictable) until the
        step's copies complete, like ``pinned`` (the step's hits, being loaded)."""
        for key in keys:
            if self.insert(key, pinned):
                pinned.add(key)


class TierSimulator:
    """Miniature simulations of one lower tier of ``capacity_blocks`` at the sizes ``FACTORS``."""

    def __init__(self, capacity_blocks: int, max_keys: int = 8192) -> None:
        if max_keys < 16:
            raise ValueError(f"max_keys must be at least 16, got {max_keys}")
        self.capacity_blocks = capacity_blocks
        self.max_keys = max_keys
        self.threshold = MODULUS
        self.caches = [_MiniCache(f * capacity_blocks) for f in FACTORS]
        self._tracked: set[bytes] = set()
        self._heap: list[tuple[int, bytes]] = []  # (-hash, key): the largest hash on top
        self.total = 0.0
        self.num_lookups = 0
        self.num_sampled = 0

    @property
    def rate(self) -> float:
        return self.threshold / MODULUS

    # ------------------------------------------------------------------------------ the stream
    def lookup(
        self, keys: Sequence[bytes], promoted: Sequence[bool] = (), offers: Sequence[bytes] = ()
    ) -> None:
        """Blocks asked of the tier, in prompt order; ``promoted[i]``: a slower tier served block ``i``
        through this one (stored here on its way up); ``offers``: blocks the same step's allocation
        hands down. As in the tiers: the lookup's hits are pinned while those are stored, and then
        loaded (the most recent)."""
        self.num_lookups += len(keys)
        sampled = [(i, k) for i, k in enumerate(keys) if self._sample(k)]
        offered = [k for k in offers if self._sample(k)]
        self.num_sampled += len(sampled)
        self.total += len(sampled) / self.rate
        for cache in self.caches:
            n = 0  # leading sampled hits: a block hits only if the ones before it did
            while n < len(sampled) and sampled[n][1] in cache.held:
                n += 1
            hits = [key for _, key in sampled[:n]]
            for key in hits:  # the MRU end: stores evict from the LRU end without scanning past them
                cache.held.move_to_end(key)
            cache.insert_all(offered, set(hits))
            for key in hits:  # then the most recent, after the stores
                cache.held.move_to_end(key)
            cache.hits += n / self.rate
            for i, key in sampled[n:]:
                if i < len(promoted) and promoted[i]:
                    cache.insert(key)

    def offer(self, keys: Sequence[bytes]) -> None:
        """Blocks the tier above hands down (write-back or write-through): stored iff not held."""
        sampled = [k for k in keys if self._sample(k)]
        for cache in self.caches:
            cache.insert_all(sampled, set())

    def snapshot(self) -> SimSnapshot:
        return SimSnapshot(
            tuple(c.size for c in self.caches),
            tuple(c.hits for c in self.caches),
            self.total,
            self.num_lookups,
            self.num_sampled,
            self.rate,
            len(self._tracked),
        )

    # ------------------------------------------------------------------------------ sampling
    def _sample(self, key: bytes) -> bool:
        """Is ``key`` under the threshold (tracking it, and shrinking past ``max_keys``)?"""
        h = key_hash(key)
        if h >= self.threshold:
            return False
        if key not in self._tracked:
            self._tracked.add(key)
            heapq.heappush(self._heap, (-h, key))
            self._shrink()
        return h < self.threshold

    def _shrink(self) -> None:
        """Over ``max_keys``: lower the threshold past the largest tracked hashes, forgetting those
        keys, until ``SHRINK_SLACK`` of ``max_keys`` is free (one shrink per many new keys, not one
        per key: each shrink trims every simulated size)."""
        if len(self._tracked) <= self.max_keys:
            return
        target = self.max_keys - self.max_keys // SHRINK_SLACK
        gone: set[bytes] = set()
        while len(self._tracked) - len(gone) > target:
            gone |= self._lower_threshold(-self._heap[0][0])
        self._forget(gone)

    def halve_rate(self) -> None:
        """Sample half as many keys from now on (the engine's replay could not keep up): the threshold
        halves, the keys at or above it are forgotten, each simulated size holds half as many."""
        self._forget(self._lower_threshold(max(1, self.threshold // 2)))

    def _lower_threshold(self, threshold: int) -> set[bytes]:
        """Sample keys under ``threshold`` only; the tracked keys at or above it (to ``_forget``)."""
        self.threshold = threshold
        gone = set()
        while self._heap and -self._heap[0][0] >= threshold:
            gone.add(heapq.heappop(self._heap)[1])
        return gone

    def _forget(self, gone: set[bytes]) -> None:
        self._tracked -= gone
        for cache in self.caches:
            for key in gone & cache.held.keys():
                del cache.held[key]
            cache.set_rate(self.rate)
