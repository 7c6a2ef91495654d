"""``CacheInsight``: what the engine tells ``kvtier/insight`` and what it answers.

::

    KVCacheManager.observer ──on_adopt(seq, tokens, AdoptedPrefix)──► device tracker: lookup (every block)
                                                                   ├► host, disk simulators: the blocks
                                                                   │  asked of them (faster tiers missed)
                                                                   └► Canary.on_adopt (sampled)
                            ──on_cached / on_freed(keys)────────────► device tracker: insert
    TierCoordinator.on_offered(medium, keys) ────────────────────────► that tier's simulator: offer
                            (held back until the lookup of the same step: the real lookup comes first)
    LLMEngine._execute      ──canary.capture(kv_cache)     LLMEngine.run_idle_work ──canary.run_one(model)
    GET /v1/kv/advice       ──advice(sizes, costs)         GET /v1/kv/canary       ──canary.report(...)

The trackers are bookkeeping, not serving: the events they replay (every block of every lookup,
thirteen simulated sizes per lower tier) are queued as they happen and replayed in order by ``drain``,
which the engine runs when no request waits (``LLMEngine.run_idle_work``, in slices of ``IDLE_SLICE_S``
so that a request arriving meanwhile waits little), and which ``advice`` and ``snapshots`` run before
they read. Under steady load (no idle moment), a backlog past ``SOFT_BACKLOG_KEYS`` replays a slice
before each step (``catch_up``): on average ``STEP_SHARE`` of the steps' time. A stream the slices
cannot keep up with (the backlog past ``SHED_BACKLOG_KEYS``, then past twice that, ...) halves every
tracker's sampling rate (``shed``): the curves get noisier, the steps never slower. Past
``MAX_BACKLOG_KEYS`` the backlog drains at once (bounded memory).
The counters and the canary see each event as it happens.

The device pool is an LRU over one stream (every lookup, computed and freed block): a reuse-distance
tracker (``mrc.ReuseTracker``) gives its curve. The host and disk tiers admit blocks by their own rules
(a store of a block they hold is no refresh, a miss is not stored): once ``attach`` has their sizes,
each gets miniature simulations of those rules (``minisim.TierSimulator``). The trackers see every
adopted lookup (sampling is their own business); the counters of blocks served per tier are exact, for
the measured hit ratio next to the estimated one.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from kvtier.insight.advice import Advisor, Costs, TierSize
from kvtier.insight.canary import Canary
from kvtier.insight.minisim import TierSimulator
from kvtier.insight.mrc import MODULUS, ReuseTracker, key_hash
from kvtier.kv.computed import AdoptedPrefix
from kvtier.kv.hashing import BlockHash
from kvtier.stats import Medium

logger = logging.getLogger("kvtier.insight")

# Block keys queued for the trackers: past SOFT, each step earns STEP_SHARE of its time (MIN_SLICE_S at
# least, MAX_CREDIT_S banked at most) and spends it replaying the oldest events, at most STEP_SLICE keys (a
# server under steady load never idles): a fixed 2,048 keys a step took 8.5 ms on a 2-core Xeon (up to
# 18), as long as a decode step on a GPU. Past SHED keys, the trackers sample half as many keys (again at
# twice the backlog, ...); past MAX, all at once (a bound on memory whatever happens).
SOFT_BACKLOG_KEYS = 1 << 13
STEP_SLICE_KEYS = 1 << 11
STEP_SHARE = 0.05
MIN_SLICE_S = 0.0002
MAX_CREDIT_S = 0.05
IDLE_SLICE_S = 0.02
SHED_BACKLOG_KEYS = 1 << 15
MAX_BACKLOG_KEYS = 1 << 20


class _Coordinator(Protocol):  # kvtier.tiers.coordinator.TierCoordinator, as attach uses it
    tiers: Any
    on_stored: Any
    on_offered: Any


class CacheInsight:
    def __init__(
        self,
        canary_rate: float,
        block_size: int,
        dtype: str,
        seed: int = 0,
        max_keys: int = 8192,
        lower: Sequence[Medium] = (),
    ):
        # One tracker per tier with a capacity: the device pool, and the lower tiers in order.
        self.lower = [m for m in lower if m != Medium.REMOTE]
        self.max_keys = max_keys
        self.trackers: dict[Medium, Any] = {m: ReuseTracker(max_keys) for m in [Medium.DEVICE, *self.lower]}
        self.tracker = self.trackers[Medium.DEVICE]
        self._offers: list[tuple[Medium, Sequence[BlockHash]]] = []  # not yet told to the simulators
        self._backlog: list[tuple[Callable[..., None], tuple[Any, ...]]] = []  # events not yet replayed
        self._backlog_keys = 0
        self._shed_at = SHED_BACKLOG_KEYS  # the backlog that halves the sampling rates next
        self._credit_s = 0.0  # replay time the steps earned and did not spend (negative: overspent)
        self.num_sheds = 0
        self.canary = Canary(canary_rate, block_size, dtype, seed)
        self.num_requests = 0  # adopted lookups (one per admitted prompt)
        self.asked: Counter[Medium] = Counter()  # blocks looked up in each tier
        self.served: Counter[Medium] = Counter()  # blocks served, by tier

    # ------------------------------------------------------------------------------ events (queued)
    def on_adopt(self, seq_id: str, token_ids: Sequence[int], adopted: AdoptedPrefix) -> None:
        self.num_requests += 1
        keys, served = tuple(adopted.keys), tuple(adopted.served_by)
        self.served.update(served)
        self.asked[Medium.DEVICE] += len(keys)
        asked = len(keys) - served.count(Medium.DEVICE)
        for medium in self.lower:  # each tier is asked what the faster ones did not serve
            self.asked[medium] += asked
            asked -= served.count(medium)
        threshold = max(t.threshold for t in self.trackers.values())
        unsampled: tuple[Medium | None, ...] = ()  # who served each key left out (None: a miss)
        if threshold < MODULUS:
            out = [key_hash(k) >= threshold for k in keys]
            unsampled = tuple(served[i] if i < len(served) else None for i, o in enumerate(out) if o)
            served = tuple(m for m, o in zip(served, out, strict=False) if not o)
            keys = tuple(k for k, o in zip(keys, out, strict=True) if not o)
        self._queue(self._replay_adopt, served, unsampled, keys)
        self.canary.on_adopt(token_ids, adopted)

    def on_cached(self, keys: Sequence[BlockHash]) -> None:
        self._queue(self._replay_cached, self._sampled(keys, Medium.DEVICE))

    def on_freed(self, keys: Sequence[BlockHash]) -> None:
        # the pool evicts a freed sequence's tail first
        self._queue(self._replay_cached, self._sampled(keys[::-1], Medium.DEVICE))

    def on_offered(self, medium: Medium, keys: Sequence[BlockHash]) -> None:
        """The tier above offered ``keys`` to ``medium`` (stored unless held); told to its simulator
        after the step's lookup (which, in the tiers, ran before the allocation that evicted them)."""
        if isinstance(self.trackers.get(medium), TierSimulator):
            self._queue(self._replay_offered, medium, self._sampled(keys, medium))

    def on_stored(self, medium: Medium, keys: Sequence[BlockHash]) -> None:
        """A lower tier stored ``keys`` (from the tier above): references in a reuse tracker's stream
        (a simulator decides what is stored itself, from the offers)."""
        if isinstance(self.trackers.get(medium), ReuseTracker):
            self._queue(self._replay_stored, medium, self._sampled(keys, medium))

    def _sampled(self, keys: Sequence[BlockHash], medium: Medium) -> tuple[BlockHash, ...]:
        """``keys`` less those ``medium``'s tracker will never sample: its threshold only falls, so a
        key at or above it now is skipped by the replay too (the queue and the replay shrink with the
        sampling rate; a lookup's left-out keys are still counted, ``_replay_adopt``)."""
        threshold = self.trackers[medium].threshold
        if threshold >= MODULUS:
            return tuple(keys)
        return tuple(k for k in keys if key_hash(k) < threshold)

    def _queue(self, replay: Callable[..., None], *args: Any) -> None:
        """Queue ``replay(*args)``; the last argument is the event's keys."""
        self._backlog.append((replay, args))
        self._backlog_keys += len(args[-1])
        if self._backlog_keys > MAX_BACKLOG_KEYS:
            self.drain()

    @property
    def has_backlog(self) -> bool:
        return bool(self._backlog)

    def drain(self, max_keys: int | None = None, budget_s: float | None = None) -> float:
        """Replay the queued events into the trackers, in the order they happened: all of them (and the
        offers they hold back), or the oldest, up to ``max_keys`` block keys, while less than
        ``budget_s`` seconds were spent (none when it is not positive). Returns the seconds spent."""
        t0 = time.perf_counter()
        if max_keys is None and budget_s is None:
            backlog, self._backlog, self._backlog_keys = self._backlog, [], 0
            for replay, args in backlog:
                replay(*args)
            self._flush_offers()
            return time.perf_counter() - t0
        end = math.inf if budget_s is None else t0 + budget_s
        done = keys = 0
        for replay, args in self._backlog:
            if (max_keys is not None and keys >= max_keys) or time.perf_counter() >= end:
                break
            replay(*args)
            keys += len(args[-1])
            done += 1
        del self._backlog[:done]
        self._backlog_keys -= keys
        return time.perf_counter() - t0

    def catch_up(self, step_s: float = 0.0) -> None:
        """Before a step, past ``SOFT_BACKLOG_KEYS``: replay the oldest events with the time the steps
        earned (``STEP_SHARE`` of the last one's ``step_s``; an event that overran it is paid back by the
        next steps); ``shed`` when the backlog still grows. The rest waits for idle time."""
        if self._backlog_keys <= SOFT_BACKLOG_KEYS:
            self._shed_at, self._credit_s = SHED_BACKLOG_KEYS, 0.0  # caught up
            return
        self._credit_s = min(MAX_CREDIT_S, self._credit_s + max(MIN_SLICE_S, STEP_SHARE * step_s))
        self._credit_s -= self.drain(STEP_SLICE_KEYS, self._credit_s)
        if self._backlog_keys > self._shed_at:
            self.shed()
            self._shed_at *= 2

    def shed(self) -> None:
        """Every tracker samples half as many keys from now on: the replay that cannot keep up with the
        stream costs half as much per key (the queued keys past the new thresholds replay as skips)."""
        for tracker in self.trackers.values():
            tracker.halve_rate()
        self.num_sheds += 1
        logger.warning(
            "cache insight: its replay fell %d block keys behind; sampling rate halved (to %.3g)",
            self._backlog_keys, self.tracker.rate,
        )  # fmt: skip

    def snapshots(self) -> dict[Medium, Any]:
        """Every tracker's snapshot, the backlog replayed first."""
        self.drain()
        return {m: t.snapshot() for m, t in self.trackers.items()}

    # ------------------------------------------------------------------------------ the replay
    def _replay_adopt(
        self, served: Sequence[Medium], unsampled: Sequence[Medium | None], keys: Sequence[BlockHash]
    ) -> None:
        """A lookup of ``keys`` (``served``: by whom, the hits leading), less the keys no tracker
        samples, which each tier that was asked for them counts all the same (``unsampled``: who
        served each of those, None: nobody)."""
        self.tracker.lookup(keys)
        self.tracker.num_lookups += len(unsampled)
        faster = {Medium.DEVICE}
        asked = keys[served.count(Medium.DEVICE) :]  # device hits lead the prefix
        sources = served[len(keys) - len(asked) :]
        for medium in self.lower:  # each tier is asked what the faster ones did not serve
            self.trackers[medium].num_lookups += sum(1 for m in unsampled if m not in faster)
            faster.add(medium)
            tracker = self.trackers[medium]
            if isinstance(tracker, TierSimulator):  # host: blocks read up from below are stored in it
                below = medium == Medium.HOST
                promoted = [below and m not in (Medium.HOST, Medium.DEVICE) for m in sources]
                tracker.lookup(asked, promoted, self._take_offers(medium))
            else:
                tracker.lookup(asked, [m == medium for m in sources])
            kept = [i for i in range(len(asked)) if i >= len(sources) or sources[i] != medium]
            asked = [asked[i] for i in kept]
            sources = tuple(sources[i] for i in kept if i < len(sources))
        self._flush_offers()

    def _replay_cached(self, keys: Sequence[BlockHash]) -> None:
        self._flush_offers()
        self.tracker.insert(keys)

    def _replay_offered(self, medium: Medium, keys: Sequence[BlockHash]) -> None:
        self._offers.append((medium, keys))

    def _replay_stored(self, medium: Medium, keys: Sequence[BlockHash]) -> None:
        self.trackers[medium].insert(keys)

    def attach(self, coordinator: _Coordinator) -> None:
        """Follow the lower tiers of ``coordinator``: one simulator per tier with a capacity, told of
        the blocks offered to it."""
        for tier in coordinator.tiers:
            if tier.medium in self.trackers and tier.medium != Medium.DEVICE:
                self.trackers[tier.medium] = TierSimulator(tier.capacity_blocks, self.max_keys)
        coordinator.on_stored = self.on_stored
        coordinator.on_offered = self.on_offered

    def _take_offers(self, medium: Medium) -> list[BlockHash]:
        """The pending offers to ``medium`` (this step's allocation's), in order; the others stay."""
        taken = [k for m, keys in self._offers if m == medium for k in keys]
        self._offers = [(m, keys) for m, keys in self._offers if m != medium]
        return taken

    def _flush_offers(self) -> None:
        for medium, keys in self._offers:
            self.trackers[medium].offer(keys)
        self._offers.clear()

    def advice(self, sizes: list[TierSize], costs: Costs, sentences: bool = True) -> dict[str, Any]:
        """``GET /v1/kv/advice``'s body: per-tier curves, measured ratios and sentences."""
        self.drain()
        sizes = [
            replace(
                t,
                snap=self.trackers[Medium(t.medium)].snapshot(),
                num_asked=self.asked[Medium(t.medium)],
                num_served=self.served[Medium(t.medium)],
            )
            for t in sizes
            if Medium(t.medium) in self.trackers
        ]
        lookups = self.asked[Medium.DEVICE]
        answer = Advisor(sizes, costs, lookups, self.num_requests).to_json(sentences)
        served = 0
        for size in sizes:  # cumulative through each tier, measured
            served += size.num_served
            if size.medium in answer["tiers"]:
                answer["tiers"][size.medium]["measured_hit_ratio"] = (
                    round(served / lookups, 6) if lookups else 0.0
                )
        return answer
