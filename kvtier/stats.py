"""Engine statistics: one snapshot type the server's metrics, the CLI and benchmarks all read.

``LLMEngine.stats()`` returns an :class:`EngineStats`. Counters are cumulative since the engine
started (Prometheus counters are built from them by differencing); gauges are current values.
Torch-free plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierSnapshot:
    """One tier (``tier`` is "device", "host" or "disk"). Lookups and hits count blocks."""

    tier: str
    capacity_blocks: int
    used_blocks: int
    lookups: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_stored: int = 0
    bytes_stored: int = 0
    store_seconds: float = 0.0
    blocks_evicted: int = 0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.capacity_blocks if self.capacity_blocks else 0.0


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int  # sequences in the running batch
    num_requests_waiting: int  # sequences queued (new, preempted or waiting for a disk load)
    kv_cache_usage: float  # fraction of device blocks referenced by running sequences, in [0, 1]
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (all tiers)
    prefix_cache_hits: int  # of those, tokens served from some tier instead of computed
    num_preemptions: dict[str, int]  # by mode: {"swap": ..., "recompute": ...}
    prompt_tokens: int  # prompt tokens of admitted requests
    generation_tokens: int  # tokens sampled
    tiers: dict[str, TierSnapshot] = field(default_factory=dict)  # "device", "host", "disk"
