"""The sizing trackers (``kvtier/insight``) replay their events when the engine is idle, not in a step.

Every lookup feeds a reuse-distance tracker and thirteen simulated sizes of each lower tier: on an H200
that bookkeeping was most of a host-tier hit's time to first token (an 8k-token prompt: 60 ms before,
28 ms after). The events are queued in order and replayed by ``run_idle_work`` (the server's idle
loop, in slices), by ``advice`` and ``snapshots`` before they read, or at once past a cap. The story:
two engines serve the same requests, one replaying after each request and one never; their curves are
the same. Under steady load each step replays with the time it earned (a share of its own), and a
stream that outruns it halves the trackers' sampling rates instead of slowing the steps.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import pytest

import kvtier.insight.hub as hub
from kvtier.config_checks import ConfigError
from kvtier.insight.hub import CacheInsight
from kvtier.insight.minisim import TierSimulator
from kvtier.insight.mrc import ReuseTracker
from kvtier.kv.computed import AdoptedPrefix
from kvtier.llm import LLM
from kvtier.sampling_params import SamplingParams
from kvtier.stats import Medium
from kvtier.tiers.coordinator import TierCoordinator
from kvtier.tiers.host import HostTier

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)
SYSTEM = [7 + (i * 13) % 480 for i in range(48)]
PROMPTS = [SYSTEM + [11 + (i * 31 + j * 7) % 470 for j in range(40 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Any) -> str:
    return str(tiny_llama_dir())


def engine(tiny: str) -> LLM:
    """A small pool over a host tier: the later prompts evict the earlier ones' blocks to the host."""
    return LLM(model=tiny, kv_device_blocks=14, kv_host_gb=24 * 8192 / 2**30)


def test_a_step_queues_the_trackers_events_and_idle_work_replays_them(tiny: str) -> None:
    llm = engine(tiny)
    e = llm.engine
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    assert e.insight.has_backlog and e.has_idle_work
    assert e.insight.tracker.num_lookups == 0  # not yet replayed ...
    assert e.insight.asked[Medium.DEVICE] > 0  # ... though the counters are current
    assert e.run_idle_work() is True
    assert not e.insight.has_backlog and e.insight.tracker.num_lookups == e.insight.asked[Medium.DEVICE]
    assert e.run_idle_work() is False  # nothing waits (no canary check either: its rate is 0)


def test_replayed_late_or_at_once_the_curves_are_the_same(tiny: str) -> None:
    """Order is all that matters: the replay at the end sees the events in the order they happened."""
    eager, lazy = engine(tiny), engine(tiny)
    for prompt in PROMPTS + PROMPTS[::-1]:
        for llm in (eager, lazy):
            llm.generate([{"prompt_token_ids": prompt}], GREEDY)
        while eager.engine.run_idle_work():
            pass
    assert lazy.engine.insight.has_backlog
    got, want = lazy.engine.insight.snapshots(), eager.engine.insight.snapshots()
    assert got == want and want[Medium.HOST].num_lookups > 0
    assert lazy.engine.kv_advice() == eager.engine.kv_advice()


def test_under_steady_load_each_step_replays_a_slice_and_the_curves_stay_exact(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No idle moment: past the soft limit a step replays the oldest events, a few keys at a time, so
    the backlog stays near that limit; the curves end as if replayed at once."""
    monkeypatch.setattr(hub, "SOFT_BACKLOG_KEYS", 12)
    monkeypatch.setattr(hub, "STEP_SLICE_KEYS", 6)
    monkeypatch.setattr(hub, "STEP_SHARE", 1e9)  # time to spare: the slice is bounded by its keys
    eager, busy = engine(tiny), engine(tiny)
    most = 0
    for prompt in PROMPTS + PROMPTS[::-1]:
        for llm in (eager, busy):
            llm.generate([{"prompt_token_ids": prompt}], GREEDY)
        while eager.engine.run_idle_work():
            pass
        most = max(most, busy.engine.insight._backlog_keys)
    assert busy.engine.insight.has_backlog and most < 12 + 40  # the limit, and one request's keys
    assert busy.engine.insight.snapshots() == eager.engine.insight.snapshots()


def test_a_step_replays_with_the_time_the_steps_earned_and_pays_back_an_overrun() -> None:
    """Each step earns ``STEP_SHARE`` of its time for the replay; one event that took longer (5 ms
    here, against 0.5 ms earned a step) is paid back by the following steps, which replay nothing."""
    insight = CacheInsight(0.0, 16, "float32")
    ran: list[int] = []

    def slow(i: int, keys: tuple[bytes, ...]) -> None:
        time.sleep(0.005)
        ran.append(i)

    for i in range(3):  # past the soft limit in keys
        insight._queue(
            slow, i, tuple(bytes([i, k % 256, k // 256]) * 11 for k in range(hub.SOFT_BACKLOG_KEYS))
        )
    insight.catch_up(step_s=0.01)  # earns 0.5 ms: the oldest event runs, 5 ms
    assert ran == [0]
    for _ in range(9):
        insight.catch_up(step_s=0.01)  # 4.5 ms more earned: still in debt
    assert ran == [0]
    for _ in range(40):
        insight.catch_up(step_s=0.01)
    assert ran[:2] == [0, 1]


def test_a_stream_the_replay_cannot_keep_up_with_halves_the_sampling_rates(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps earn no replay time here: the backlog grows, and past the shed mark every tracker samples
    half as many keys (then again only past twice the backlog); replayed at last, the curves are
    estimates at the lower rate, and the next backlog starts from the first mark."""
    monkeypatch.setattr(hub, "SOFT_BACKLOG_KEYS", 12)
    monkeypatch.setattr(hub, "SHED_BACKLOG_KEYS", 40)
    monkeypatch.setattr(hub, "STEP_SHARE", 0.0)
    monkeypatch.setattr(hub, "MIN_SLICE_S", 0.0)
    llm = engine(tiny)
    insight = llm.engine.insight
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    rates = {m: t.rate for m, t in insight.trackers.items()}
    assert insight.num_sheds == 0 and set(rates.values()) == {1.0}
    for prompt in PROMPTS[1:4]:
        llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    assert insight.num_sheds >= 1 and insight._backlog_keys > 40
    assert all(t.rate == 0.5**insight.num_sheds for t in insight.trackers.values())
    assert insight._shed_at == 40 * 2**insight.num_sheds
    while llm.engine.run_idle_work():
        pass
    snaps = insight.snapshots()
    assert snaps[Medium.DEVICE].sampling_rate == 0.5**insight.num_sheds and snaps[Medium.HOST].num_lookups > 0
    llm.generate([{"prompt_token_ids": PROMPTS[4]}], GREEDY)  # caught up before this step: marks reset
    assert insight._shed_at == 40


def test_a_backlog_past_its_cap_replays_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "MAX_BACKLOG_KEYS", 10)
    insight = CacheInsight(0.0, 16, "float32")
    keys = [bytes([i]) * 32 for i in range(6)]
    insight.on_cached(keys)
    assert insight.has_backlog and insight.tracker.snapshot().num_tracked == 0
    insight.on_freed(keys)  # 12 keys queued: past the cap
    assert not insight.has_backlog and insight.tracker.snapshot().num_tracked == 6


def test_a_prompt_token_outside_the_vocabulary_is_named(tiny: str) -> None:
    llm = engine(tiny)
    for bad in (-1, 512, True, 3.0):
        with pytest.raises(ConfigError, match=rf"prompt token id {bad!r} is outside the vocabulary"):
            llm.generate([{"prompt_token_ids": [5, 6, bad]}], GREEDY)


def synthetic_stream(insight: CacheInsight, seed: int) -> int:
    """Lookups of chained prompts over 300 blocks (device hits, then host hits, then misses), their
    blocks cached, freed and offered to the host tier; the keys queued in all."""
    rng = random.Random(seed)
    queued = 0
    for r in range(400):
        doc = rng.randrange(40)
        keys = [hashlib.sha256(f"{doc}-{b}".encode()).digest() for b in range(rng.randint(1, 12))]
        on_device, on_host = rng.randint(0, len(keys)), rng.randint(0, 3)
        served = [Medium.DEVICE] * on_device + [Medium.HOST] * min(on_host, len(keys) - on_device)
        insight.on_adopt(f"s{r}", [], AdoptedPrefix(tuple(keys), tuple(served), tuple(range(len(served)))))
        insight.on_cached(keys[len(served) :])
        insight.on_freed(keys)
        insight.on_offered(Medium.HOST, keys[::-1][: rng.randint(0, len(keys))])
        queued += insight._backlog_keys
        insight.drain(rng.choice([None, 5, 50]))  # replayed late, in slices, or at once: all the same
    insight.drain()
    return queued


def test_keys_no_tracker_samples_are_left_out_of_the_queue_and_the_curves_do_not_move(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``max_keys`` distinct blocks the trackers sample; a key above every threshold is never
    replayed (thresholds only fall), so it is not queued: less work, the same snapshots."""

    def insight() -> CacheInsight:
        made = CacheInsight(0.0, 16, "float32", max_keys=64, lower=[Medium.HOST])
        made.attach(TierCoordinator(HostTier(48)))
        return made

    filtered = insight()
    queued = synthetic_stream(filtered, seed=3)
    monkeypatch.setattr(hub, "key_hash", lambda key: 0)  # every key under every threshold: none left out
    everything = insight()
    assert synthetic_stream(everything, seed=3) > 1.5 * queued
    got, want = filtered.snapshots(), everything.snapshots()
    assert want[Medium.DEVICE].sampling_rate < 0.5 and want[Medium.HOST].sampling_rate < 0.5
    assert got == want and want[Medium.HOST].num_lookups == filtered.asked[Medium.HOST]


@pytest.mark.parametrize("make", [lambda: ReuseTracker(4096), lambda: TierSimulator(64, 4096)])
def test_halving_a_trackers_rate_forgets_the_keys_past_the_new_threshold(make: Any) -> None:
    tracker = make()
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(400)]
    feed = tracker.lookup if isinstance(tracker, TierSimulator) else tracker.insert
    feed(keys)
    before = tracker.snapshot().num_tracked
    tracker.halve_rate()
    after = tracker.snapshot()
    assert after.sampling_rate == 0.5 and 0.35 * before < after.num_tracked < 0.65 * before
    tracked = tracker._tracked if isinstance(tracker, TierSimulator) else tracker._last
    assert all(hub.key_hash(k) < tracker.threshold for k in tracked)
    feed(keys[::-1])  # the stream goes on at the new rate
    assert tracker.snapshot().num_tracked == after.num_tracked
