"""Miss-ratio curves of the block-key stream: a SHARDS-style sampled reuse-distance tracker.

The engine tells the tracker every prefix lookup it adopts (the full prompt blocks looked up, in
order) and every block newly entered into the device cache. For an LRU cache, a reference hits iff its
*reuse distance* (distinct blocks referenced since the block's previous reference) is below the cache's
capacity in blocks, so one histogram of reuse distances gives the hit ratio at every capacity::

    access stream   a b c a d b ...          distance(a, 2nd time) = |{b, c}| = 2
    histogram       weight by distance        hit_ratio(C) = weight(distance < C) / weight(all lookups)

Spatial sampling (SHARDS, Waldspurger et al., FAST'15): a block is tracked iff the low 24 bits of its
key (a sha256, so uniform) fall under a threshold ``T``; sampled at rate ``R = T / 2^24``, a distance
of ``d`` sampled blocks stands for ``d / R`` real ones and each sampled lookup for ``1 / R``. Fixed-size
variant: at most ``max_keys`` blocks are tracked; when one more would be, the threshold drops to the
largest tracked hash and the blocks at or above it are forgotten, so memory stays bounded however long
the stream. Distances come from a Fenwick tree over access times (O(log n) per reference), compacted
when the clock reaches its end. Histogram buckets grow geometrically by 2% (bounded too).

A prompt only reuses a block if it reuses every block before it (the chain of hashes); the tracker
takes that into account by giving each sampled lookup the largest distance of the sampled blocks
before it in the same prompt. Deterministic: the same stream gives the same curve (no randomness;
sampling depends only on the keys). Torch-free.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

MODULUS = 1 << 24
BUCKET_GROWTH = 1.02
COLD = -1  # the bucket of first references (a miss at every capacity)


def key_hash(key: bytes) -> int:
    """The sampling hash of a block key: its low 24 bits (keys are sha256 digests, uniform)."""
    return int.from_bytes(key[-3:], "little")


def bucket_of(distance: float) -> int:
    """Histogram bucket of a reuse distance in blocks: 0 for [0, 1), then 2% wide geometric buckets."""
    if distance < 1.0:
        return 0
    return 1 + int(math.log(distance) / math.log(BUCKET_GROWTH))


def bucket_floor(bucket: int) -> float:
    """The smallest distance in ``bucket``."""
    return 0.0 if bucket <= 0 else BUCKET_GROWTH ** (bucket - 1)


class _Fenwick:
    """Counts of live access times 1..size; prefix sums in O(log size)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tree = [0] * (size + 1)

    def add(self, i: int, delta: int) -> None:
        tree, size = self.tree, self.size
        while i <= size:
            tree[i] += delta
            i += i & -i

    def between(self, lo: int, hi: int) -> int:
        """Live times in ``(lo, hi]`` (``lo <= hi``): the two prefix walks, stopped where they meet."""
        tree, total = self.tree, 0
        while hi != lo:
            if hi > lo:
                total += tree[hi]
                hi -= hi & -hi
            else:
                total -= tree[lo]
                lo -= lo & -lo
        return total


@dataclass(frozen=True)
class TrackerSnapshot:
    """The histogram at one moment (what the curves are computed from)."""

    histogram: dict[int, float]  # bucket -> estimated lookups (COLD: first references)
    num_lookups: int  # lookups seen (every block, sampled or not)
    num_sampled: int  # sampled lookup references
    sampling_rate: float
    num_tracked: int  # blocks tracked now (<= max_keys)

    @cached_property
    def _cumulative(self) -> tuple[list[float], list[float], float]:
        """(bucket floors ascending, weight of the buckets up to each, total weight incl. COLD)."""
        floors, cumulative, running = [], [], 0.0
        for b in sorted(b for b in self.histogram if b != COLD):
            running += self.histogram[b]
            floors.append(bucket_floor(b))
            cumulative.append(running)
        return floors, cumulative, sum(self.histogram.values())

    def hit_ratio(self, capacity_blocks: float) -> float:
        """Estimated fraction of looked-up blocks an LRU cache of ``capacity_blocks`` would have held."""
        floors, cumulative, total = self._cumulative
        n = bisect.bisect_left(floors, capacity_blocks)  # buckets whose smallest distance fits
        return cumulative[n - 1] / total if n and total > 0 else 0.0


class ReuseTracker:
    """Sampled reuse distances of block keys, in at most ``max_keys`` tracked blocks."""

    def __init__(self, max_keys: int = 8192, initial_rate: float = 1.0) -> None:
        if max_keys < 16:
            raise ValueError(f"max_keys must be at least 16, got {max_keys}")
        self.max_keys = max_keys
        self.threshold = max(1, min(MODULUS, int(initial_rate * MODULUS)))
        self._last: dict[bytes, int] = {}  # tracked key -> its latest access time
        self._heap: list[tuple[int, bytes]] = []  # (-hash, key): the largest hash on top
        self._clock_size = 4 * max_keys
        self._times = _Fenwick(self._clock_size)
        self._now = 0
        self.histogram: dict[int, float] = {}
        self.num_lookups = 0
        self.num_sampled = 0

    @property
    def rate(self) -> float:
        return self.threshold / MODULUS

    # ------------------------------------------------------------------------------ the stream
    def lookup(self, keys: Sequence[bytes], touched: Sequence[bool] | None = None) -> None:
        """One prompt's full blocks, in order: each is a lookup (counted) and a reference. A tier that
        only refreshes a block when it serves it (the host and disk tiers: a miss is not stored there
        by the lookup) passes ``touched``: which keys it served; the others are measured, not moved."""
        self.num_lookups += len(keys)
        chain = 0.0  # the largest distance so far in this prompt: a block hits only if its parents do
        for i, key in enumerate(keys):
            distance = self._reference(key, touch=touched is None or (i < len(touched) and touched[i]))
            if distance is None:
                continue
            chain = math.inf if distance < 0 else max(chain, distance)
            self._record(chain)

    def insert(self, keys: Sequence[bytes]) -> None:
        """Blocks entered into the cache (computed): references that are not lookups."""
        for key in keys:
            self._reference(key)

    def snapshot(self) -> TrackerSnapshot:
        return TrackerSnapshot(
            dict(self.histogram), self.num_lookups, self.num_sampled, self.rate, len(self._last)
        )

    # ------------------------------------------------------------------------------ internals
    def _record(self, distance: float) -> None:
        self.num_sampled += 1
        bucket = COLD if math.isinf(distance) else bucket_of(distance)
        self.histogram[bucket] = self.histogram.get(bucket, 0.0) + 1.0 / self.rate

    def _reference(self, key: bytes, touch: bool = True) -> float | None:
        """Reference ``key``: None if not sampled; -1.0 for a first reference; else its distance in
        real blocks (distinct sampled blocks since its last reference, over the rate). ``touch``:
        it becomes the most recent (else it is only measured)."""
        h = key_hash(key)
        if h >= self.threshold:
            return None
        last = self._last.get(key)
        if not touch:
            return -1.0 if last is None else self._times.between(last, self._now) / self.rate
        if self._now >= self._clock_size:
            self._compact()
            last = self._last.get(key)
        self._now += 1
        if last is None:
            self._last[key] = self._now
            self._times.add(self._now, 1)
            heapq.heappush(self._heap, (-h, key))
            self._shrink()
            return -1.0
        distance = self._times.between(last, self._now - 1)
        self._times.add(last, -1)
        self._times.add(self._now, 1)
        self._last[key] = self._now
        return distance / self.rate

    def _shrink(self) -> None:
        """Over ``max_keys``: lower the threshold to the largest tracked hash and forget those keys."""
        while len(self._last) > self.max_keys:
            self._lower_threshold(-self._heap[0][0])

    def halve_rate(self) -> None:
        """Sample half as many keys from now on (the engine's replay could not keep up): the threshold
        halves and the tracked keys at or above it are forgotten, as a shrink does."""
        self._lower_threshold(max(1, self.threshold // 2))

    def _lower_threshold(self, threshold: int) -> None:
        """Sample keys under ``threshold`` only: the tracked ones at or above it are forgotten."""
        self.threshold = threshold
        while self._heap and -self._heap[0][0] >= threshold:
            _, key = heapq.heappop(self._heap)
            self._times.add(self._last.pop(key), -1)

    def _compact(self) -> None:
        """The clock reached its end: renumber the live access times 1..n in order."""
        order = sorted(self._last.items(), key=lambda item: item[1])
        self._times = _Fenwick(self._clock_size)
        for t, (key, _) in enumerate(order, start=1):
            self._last[key] = t
            self._times.add(t, 1)
        self._now = len(order)
