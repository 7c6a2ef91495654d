"""The lower tiers' miss-ratio curves by miniature simulation: against the real ``HostTier`` at every
simulated size, on a policy where reuse distances are wrong, sampled within bounds, and deterministic
for a recorded trace (the advice's numbers included)."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvtier.bench.advice import Trace, replay
from kvtier.insight.advice import Costs, TierSize
from kvtier.insight.minisim import FACTORS, TierSimulator
from kvtier.insight.mrc import ReuseTracker
from kvtier.tiers.host import HostTier

Stream = list[tuple[str, list[bytes]]]  # ("offer" | "lookup", keys)


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def host_stream(n: int, universe: int, seed: int = 0) -> Stream:
    """What a host tier hears: chained lookups of popular prefixes (the device missed them) and
    write-backs of blocks the device evicts, some of which it holds already."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** 0.8 for r in range(universe)]
    stream: Stream = []
    for _ in range(n):
        doc = rng.choices(range(universe), weights)[0]
        blocks = [key(doc * 16 + b) for b in range(rng.randint(1, 6))]
        stream.append(("lookup", blocks))
        if rng.random() < 0.7:
            stream.append(("offer", blocks[::-1][: rng.randint(1, len(blocks))]))
    return stream


def real_host_hits(stream: Stream, num_blocks: int) -> int:
    """The stream against the real host tier bookkeeping: a store of what it lacks, a load (which
    refreshes) of the leading blocks it holds."""
    host = HostTier(num_blocks)
    hits = 0
    for kind, keys in stream:
        if kind == "offer":
            for k in keys:
                if host.host_block_of(k) is None:
                    host.complete_store(host.prepare_store([k]).keys)
        else:
            held = keys[: host.lookup(keys)]
            host.prepare_load(held)
            host.complete_load(held)
            hits += len(held)
    return hits


def simulate(stream: Stream, capacity: int, max_keys: int = 100_000) -> TierSimulator:
    sim = TierSimulator(capacity, max_keys)
    for kind, keys in stream:
        sim.offer(keys) if kind == "offer" else sim.lookup(keys)
    return sim


def test_unsampled_simulation_is_the_real_host_tier_at_every_size() -> None:
    stream = host_stream(3000, 300)
    snap = simulate(stream, capacity=40).snapshot()  # sizes 10, 15, 20, ... 320: whole blocks
    lookups = sum(len(keys) for kind, keys in stream if kind == "lookup")
    assert snap.sampling_rate == 1.0 and snap.num_lookups == lookups == snap.total
    for f, size in zip(FACTORS, snap.sizes, strict=True):
        assert size == f * 40
        assert snap.hit_ratio(size) == real_host_hits(stream, int(size)) / lookups, size


def test_a_block_stored_again_while_held_is_not_refreshed() -> None:
    """The host tier's rule that reuse distances miss: a write-back of a block it holds changes
    nothing, so the block is evicted by age although it was "used" recently."""
    a, b, c = key(1), key(2), key(3)
    stream: Stream = [("offer", [a]), ("offer", [b]), ("offer", [a]), ("offer", [c]), ("lookup", [a])]
    sim = simulate(stream, capacity=8)  # simulated sizes 2 .. 64 blocks
    assert sim.snapshot().hit_ratio(2) == 0.0 == real_host_hits(stream, 2)  # a went out before b
    assert sim.snapshot().hit_ratio(3) == 1.0 == real_host_hits(stream, 3)
    lru = ReuseTracker()  # the same stream as plain LRU references says a (refreshed) would hit at 2
    lru.insert([a, b, a, c])
    lru.lookup([a])
    assert lru.snapshot().hit_ratio(2) == 1.0


def test_sampled_simulation_stays_bounded_and_within_five_points() -> None:
    stream = host_stream(8000, 3000, seed=1)
    sim = simulate(stream, capacity=400, max_keys=2048)  # ~10k distinct blocks: rate ~0.23
    snap = sim.snapshot()
    assert snap.sampling_rate < 0.3 and snap.num_tracked <= 2048
    assert all(len(c.held) <= max(0, round(c.size * sim.rate)) for c in sim.caches)
    lookups = sum(len(keys) for kind, keys in stream if kind == "lookup")
    for size in (100, 400, 1600):
        exact = real_host_hits(stream, size) / lookups
        assert snap.hit_ratio(size) == pytest.approx(exact, abs=0.05), (size, exact)


def test_sizes_between_the_simulated_ones_are_interpolated() -> None:
    snap = simulate(host_stream(500, 100), capacity=40).snapshot()
    lo, hi = snap.hit_ratio(40), snap.hit_ratio(60)
    assert min(lo, hi) <= snap.hit_ratio(50) <= max(lo, hi)
    assert snap.hit_ratio(5) == pytest.approx(snap.hit_ratio(10) / 2)  # towards 0 below the smallest
    assert snap.hit_ratio(10_000) == snap.hit_ratio(320)


def chat_trace(seed: int = 0, convs: int = 6, turns: int = 3) -> Trace:
    """Round-robin conversations on a shared system prompt: what ``bench multiturn`` records."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(40)]
    history = [system + [rng.randrange(1, 500) for _ in range(90)] for _ in range(convs)]
    requests = []
    for _ in range(turns):
        for c in range(convs):
            answer = [rng.randrange(1, 500) for _ in range(8)]
            requests.append((list(history[c]), answer))
            history[c] += answer + [rng.randrange(1, 500) for _ in range(20)]
    return Trace(requests, ("model", ""), 16)


def test_the_advice_for_a_recorded_trace_is_deterministic_and_the_replay_agrees() -> None:
    """The same trace through the real tier bookkeeping twice: the same curves and sentences; and
    the host curve at 2x is what a host tier twice as big really serves."""
    trace = chat_trace()
    sizes = [TierSize("device", 24, 0.0), TierSize("host", 20, 0.001)]
    costs = Costs(16, 2**20, 500.0, 1e9)
    answers = []
    for _ in range(2):
        ratio, insight = replay(trace, 24, 20, keep=True)
        answers.append(insight.advice(sizes, costs))
    assert answers[0] == answers[1]
    curve = {p["size_factor"]: p["hit_ratio"] for p in answers[0]["tiers"]["host"]["curve"]}
    assert curve[1.0] == pytest.approx(ratio, abs=1e-6) == answers[0]["tiers"]["host"]["measured_hit_ratio"]
    for f in (0.5, 2.0):
        assert curve[f] == pytest.approx(replay(trace, 24, round(20 * f))[0], abs=0.05), f
