"""``CacheInsight``: what the engine tells ``kvtier/insight`` and what it answers.

::

    KVCacheManager.observer ──on_adopt(seq, tokens, AdoptedPrefix)──► ReuseTracker.lookup (every block)
                                                                   └► Canary.on_adopt (sampled)
                            ──on_cached(keys)───────────────────────► ReuseTracker.insert
    LLMEngine._execute      ──canary.capture(kv_cache)     LLMEngine.run_idle_work ──canary.run_one(model)
    GET /v1/kv/advice       ──advice(sizes, costs)         GET /v1/kv/canary       ──canary.report(...)

The tracker sees every adopted lookup (sampling is its own business); the counters of blocks served
per tier are exact, for the measured hit ratio next to the estimated one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.insight.advice import Advisor, Costs, TierSize
from kvtier.insight.canary import Canary
from kvtier.insight.mrc import ReuseTracker
from kvtier.kv.hashing import BlockHash
from kvtier.kv.manager import AdoptedPrefix
from kvtier.stats import Medium


class CacheInsight:
    def __init__(self, canary_rate: float, block_size: int, dtype: str, seed: int = 0, max_keys: int = 8192):
        self.tracker = ReuseTracker(max_keys)
        self.canary = Canary(canary_rate, block_size, dtype, seed)
        self.num_requests = 0  # adopted lookups (one per admitted prompt)
        self.served: Counter[Medium] = Counter()  # blocks served, by tier

    def on_adopt(self, seq_id: str, token_ids: Sequence[int], adopted: AdoptedPrefix) -> None:
        self.num_requests += 1
        self.served.update(adopted.served_by)
        self.tracker.lookup(adopted.keys)
        self.canary.on_adopt(token_ids, adopted)

    def on_cached(self, keys: Sequence[BlockHash]) -> None:
        self.tracker.insert(keys)

    def advice(self, sizes: list[TierSize], costs: Costs) -> dict[str, Any]:
        """``GET /v1/kv/advice``'s body: per-tier curves, measured ratios and sentences."""
        answer = Advisor(self.tracker.snapshot(), sizes, costs, self.num_requests).to_json()
        lookups = self.tracker.num_lookups
        served = 0
        for size in sizes:  # cumulative through each tier, measured
            served += self.served.get(Medium(size.medium), 0)
            if size.medium in answer["tiers"]:
                answer["tiers"][size.medium]["measured_hit_ratio"] = (
                    round(served / lookups, 6) if lookups else 0.0
                )
        return answer
