"""The sampled reuse-distance tracker against a real LRU simulation, its memory bound, and its
determinism for a recorded trace."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

import pytest

from kvtier.insight.mrc import ReuseTracker, bucket_floor, bucket_of


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def zipf_trace(n: int, universe: int, seed: int = 0) -> list[list[bytes]]:
    """Prompts of 1-8 chained-looking blocks: popular prefixes recur, as in chat traffic."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** 0.9 for r in range(universe)]
    trace = []
    for _ in range(n):
        doc = rng.choices(range(universe), weights)[0]
        trace.append([key(doc * 16 + b) for b in range(rng.randint(1, 8))])
    return trace


def lru_hit_ratio(trace: list[list[bytes]], capacity: int) -> float:
    """A real LRU of ``capacity`` blocks; a prompt's block hits only if its parents hit."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for prompt in trace:
        chain = True
        for k in prompt:
            total += 1
            chain = chain and k in cache
            hits += chain
            cache[k] = None
            cache.move_to_end(k)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / total


def test_buckets_are_geometric_and_ordered() -> None:
    assert bucket_of(0) == 0 and bucket_of(0.5) == 0 and bucket_of(1) == 1
    for d in (1, 2, 7, 50, 1000, 123456):
        assert bucket_floor(bucket_of(d)) <= d < bucket_floor(bucket_of(d) + 1) * 1.0000001


def test_unsampled_tracker_matches_an_lru_simulation() -> None:
    trace = zipf_trace(3000, 400)
    tracker = ReuseTracker(max_keys=100_000)
    for prompt in trace:
        tracker.lookup(prompt)
    snap = tracker.snapshot()
    assert snap.sampling_rate == 1.0 and snap.num_lookups == sum(map(len, trace))
    for capacity in (8, 32, 100, 400, 1500, 5000):
        assert snap.hit_ratio(capacity) == pytest.approx(lru_hit_ratio(trace, capacity), abs=0.02), capacity


@pytest.mark.slow
def test_sampled_tracker_stays_bounded_and_within_five_points() -> None:
    trace = zipf_trace(12_000, 3000, seed=1)
    tracker = ReuseTracker(max_keys=2048)
    for prompt in trace:
        tracker.lookup(prompt)
    snap = tracker.snapshot()
    assert snap.sampling_rate < 0.2 and snap.num_tracked <= 2048
    assert len(snap.histogram) < 1200  # 2% buckets: bounded whatever the stream's length
    for capacity in (200, 1000, 4000, 12_000):
        exact = lru_hit_ratio(trace, capacity)
        assert snap.hit_ratio(capacity) == pytest.approx(exact, abs=0.05), (capacity, exact)


def test_inserted_blocks_count_for_recency_not_as_lookups() -> None:
    tracker = ReuseTracker()
    tracker.insert([key(1), key(2)])  # computed answer blocks
    tracker.lookup([key(1), key(2), key(3)])  # the next turn's prompt reuses them
    snap = tracker.snapshot()
    assert snap.num_lookups == 3
    assert snap.hit_ratio(2) == pytest.approx(2 / 3)
    assert snap.hit_ratio(1) == 0.0  # block 1 was pushed out by block 2, and block 2 needs block 1


def test_a_block_only_hits_if_its_parents_do() -> None:
    tracker = ReuseTracker()
    tracker.lookup([key(1), key(2)])
    tracker.lookup([key(2)])  # block 2 recent, block 1 older
    tracker.lookup([key(1), key(2)])  # at capacity 1, block 1 misses, so block 2 cannot hit
    assert tracker.snapshot().hit_ratio(1) == pytest.approx(1 / 5)


def test_the_same_recorded_trace_gives_the_same_curve() -> None:
    trace = zipf_trace(4000, 2000, seed=2)
    snaps = []
    for _ in range(2):
        tracker = ReuseTracker(max_keys=256)
        for prompt in trace:
            tracker.lookup(prompt)
            tracker.insert(prompt[-1:])
        snaps.append(tracker.snapshot())
    assert snaps[0] == snaps[1]
    curves = [[snap.hit_ratio(c) for c in (10, 100, 1000)] for snap in snaps]
    assert curves[0] == curves[1]
