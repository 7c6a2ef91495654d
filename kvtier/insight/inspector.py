"""What the engine tells about its KV cache, and the quarantine the canary imposes. Engine thread only.

::

    KVInspector
      quarantine(tier, keys)   the canary found blocks served from ``tier`` wrong: forget them
                               everywhere, load nothing more from ``tier`` (the device: no prefix
                               reuse at all) until release(...)
      quarantined / release    the admin view and call
      canary_report            GET /v1/kv/canary
      advice / mrc_gauges      GET /v1/kv/advice, and the miss-ratio gauges of /metrics (at most
                               one recomputation a second)
      blocks / info            GET /v1/kv/blocks and /v1/kv/info (what a router follows)

It reads the device pool (``KVCacheManager``), the tiers under it, the insight hub (canary, curves)
and the cost model; it owns none of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.insight.advice import Costs, TierSize
from kvtier.insight.hub import CacheInsight
from kvtier.kv.hashing import HASH_SPEC_VERSION, BlockHash
from kvtier.kv.manager import KVCacheManager
from kvtier.kv_events import WIRE_VERSION, KVEventRecorder, stream_key
from kvtier.scheduler.preemption import CostModel
from kvtier.stats import Medium
from kvtier.tiers.coordinator import TierCoordinator


@dataclass(frozen=True)
class CacheFacts:
    """What ``/v1/kv/info`` reports besides the live state: fixed when the engine is built."""

    replica_id: str
    model_fingerprint: str
    cache_identity: str  # a request's chain starts at root_hash((cache_identity, cache_salt or ""))
    kv_dtype: str
    kv_block_bytes: int
    num_device_blocks: int


class KVInspector:
    def __init__(
        self,
        facts: CacheFacts,
        kv: KVCacheManager,
        tiers: TierCoordinator | None,
        insight: CacheInsight,
        cost_model: CostModel,
        kv_events: KVEventRecorder | None,
    ):
        self.facts = facts
        self.kv, self.tiers, self.insight = kv, tiers, insight
        self.cost_model = cost_model
        self.kv_events = kv_events
        self._mrc: dict[tuple[str, float], float] = {}
        self._mrc_time = float("-inf")
        insight.canary.on_mismatch = self.quarantine

    # ------------------------------------------------------------------------------ quarantine
    def quarantine(self, tier: Medium, keys: list[BlockHash]) -> None:
        """``keys`` were served from ``tier`` wrong: forget them everywhere, and load nothing more from
        ``tier`` (the device: no prefix reuse at all) until ``release``."""
        for key in keys:
            self.kv.forget_block(key)
            if self.tiers is not None:
                self.tiers.forget(key, "canary mismatch")
        if tier == Medium.DEVICE:
            self.kv.device_quarantined = True
        elif self.tiers is not None:
            self.tiers.quarantine(tier)

    def quarantined(self) -> list[Medium]:
        lower = self.tiers.quarantined if self.tiers is not None else set()
        return ([Medium.DEVICE] if self.kv.device_quarantined else []) + sorted(lower, key=list(Medium).index)

    def release(self, media: Iterable[Medium]) -> list[Medium]:
        """Lift the quarantine of ``media`` (an admin call); returns those that were quarantined."""
        released = []
        for medium in media:
            if medium == Medium.DEVICE and self.kv.device_quarantined:
                self.kv.device_quarantined = False
                released.append(medium)
            elif self.tiers is not None and self.tiers.lift_quarantine(medium):
                released.append(medium)
        return released

    def canary_report(self) -> dict[str, Any]:
        return self.insight.canary.report(self.quarantined())

    # ------------------------------------------------------------------------------ sizing advice
    def advice(self, sentences: bool = True) -> dict[str, Any]:
        """Miss-ratio curves per tier, the measured hit ratios and sizing sentences."""
        sizes = [TierSize(str(Medium.DEVICE), self.kv.pool.num_blocks, 0.0)]
        for tier in self.tiers.tiers if self.tiers is not None else []:
            c = tier.counters
            per_block = c.load_seconds / c.blocks_loaded if c.blocks_loaded else 0.0
            if tier.medium != Medium.REMOTE:  # a shared store: no capacity of ours to scale
                sizes.append(TierSize(str(tier.medium), tier.capacity_blocks, per_block))
        cm = self.cost_model
        costs = Costs(self.kv.block_size, cm.block_bytes, cm.prefill_tokens_per_s, cm.transfer_bytes_per_s)
        return self.insight.advice(sizes, costs, sentences)

    def mrc_gauges(self) -> dict[tuple[str, float], float]:
        """The advice curves as ``{(tier, size factor): hit ratio}``, recomputed at most once a second."""
        now = time.monotonic()
        if now - self._mrc_time >= 1.0:
            curves = self.advice(sentences=False)["tiers"]
            self._mrc = {(t, p["size_factor"]): p["hit_ratio"] for t, c in curves.items() for p in c["curve"]}
            self._mrc_time = now
        return self._mrc

    # ------------------------------------------------------------------------------ KV inspection
    def blocks(self) -> tuple[dict[Medium, list[BlockHash]], int | None]:
        """Every block hash each medium holds, and the seq of the last event batch it reflects (None
        without events). Call between steps: pending events are closed first."""
        seq = None
        if self.kv_events is not None:
            self.kv_events.end_step()
            seq = self.kv_events.last_seq
        held = {Medium.DEVICE: [block_hash for _, block_hash in self.kv.cached_blocks()]}
        if self.tiers is not None:
            held.update(self.tiers.held_keys())
        return held, seq

    def info(self) -> dict[str, Any]:
        """What a router needs to compute this engine's block hashes and to follow its events."""
        facts, events = self.facts, self.kv_events
        return {
            "replica_id": facts.replica_id,
            "hash_spec_version": HASH_SPEC_VERSION,
            "block_size": self.kv.block_size,
            "model_fingerprint": facts.model_fingerprint,
            "kv_dtype": facts.kv_dtype,
            "kv_block_bytes": facts.kv_block_bytes,
            "num_device_blocks": facts.num_device_blocks,
            # A request's chain starts at root_hash((cache_identity, cache_salt or "")): docs/block-hashes.md
            "cache_identity": facts.cache_identity,
            "enable_prefix_caching": self.kv.enable_caching,
            "media": [str(Medium.DEVICE)] + [str(t.medium) for t in (self.tiers.tiers if self.tiers else [])],
            "events": {
                "enabled": events is not None,
                "stream": stream_key(facts.replica_id),
                "wire_version": WIRE_VERSION,
                "instance": events.instance if events is not None else None,
            },
        }
