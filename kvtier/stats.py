"""Engine statistics: the counters each tier keeps, and the snapshot everyone else reads.

Who writes what (one owner per counter record)::

    Medium.DEVICE   KVCacheManager          lookups, hits and evictions of the device pool
    Medium.HOST     HostTier                its evictions
                    TierMover               the device↔host copies it ran (blocks, bytes, seconds)
    Medium.DISK     DiskTier                loads, stores, evictions, failures, as its I/O completes
    Medium.REMOTE   RemoteTier              the same; RemoteStore: errors by kind, the breaker state
    (a tier added later owns its own record the same way)

Lookups and hits of the tiers below the device are counted when the scheduler adopts a hit (a
request held back while its blocks are read is looked up again every step, and counted once), by the
``TierCoordinator``, which alone knows which tier served each block.

``LLMEngine.stats()`` only snapshots: each tier turns its live :class:`TierCounters` into a frozen-in-time
:class:`TierSnapshot`, keyed by :class:`Medium` in :class:`EngineStats`. The server's metrics, the CLI
and the benchmarks read snapshots, never live counters. Counters are cumulative since the engine
started (Prometheus counters are built from them directly); gauges are current values. Torch-free.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field


class Medium(enum.StrEnum):
    """Where a block's bytes live, fastest first. A ``StrEnum``: ``Medium.HOST == "host"``, so
    JSON, metric labels and ``stats.tiers["host"]`` all read naturally."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


REMOTE_ERROR_KINDS = ("connect", "timeout", "missing", "corrupt", "foreign", "bad_mac", "rejected")
"""``TierSnapshot.errors`` of the remote tier (``kvtier:remote_errors_total{kind}``): the store was
unreachable, too slow; a value was gone between lookup and load (evicted, expired, flushed), damaged,
written for another model/dtype/shape, forged or unsigned, or refused by the server (out of memory)."""


@dataclass(kw_only=True)
class TierCounters:
    """Cumulative counters of one tier. Lookups and hits count blocks."""

    lookups: int = 0
    hit_blocks: int = 0
    blocks_loaded: int = 0  # blocks read out of this tier (towards the device)
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_stored: int = 0  # blocks written into this tier
    bytes_stored: int = 0
    store_seconds: float = 0.0
    blocks_evicted: int = 0
    load_failures: int = 0  # a held block that could not be read back (corrupt, I/O error): a miss

    def record_loads(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.blocks_loaded += num_blocks
        self.bytes_loaded += num_bytes
        self.load_seconds += seconds

    def record_stores(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.blocks_stored += num_blocks
        self.bytes_stored += num_bytes
        self.store_seconds += seconds


@dataclass(kw_only=True)
class TierSnapshot(TierCounters):
    """One tier at one moment: a copy of its counters plus its occupancy."""

    medium: Medium
    capacity_blocks: int
    used_blocks: int
    block_size: int = 0  # tokens per block, to express hits in tokens
    errors: dict[str, int] = field(default_factory=dict)  # failures by kind (remote: connect, timeout, ...)
    breaker_state: int = 0  # a tier behind a circuit breaker: 0 closed (in use), 1 open (skipped)
    retained_blocks: int = 0  # blocks it keeps from eviction for prompt-cache retention (kv/retention.py)

    @classmethod
    def of(
        cls, medium: Medium, counters: TierCounters, capacity_blocks: int, used_blocks: int, block_size: int
    ) -> TierSnapshot:
        copied = {f.name: getattr(counters, f.name) for f in dataclasses.fields(TierCounters)}
        return cls(
            medium=medium,
            capacity_blocks=capacity_blocks,
            used_blocks=used_blocks,
            block_size=block_size,
            **copied,
        )

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.used_blocks / self.capacity_blocks if self.capacity_blocks else 0.0


@dataclass(frozen=True)
class KVGroupUsage:
    """One KV group of the device pool (``kvtier/kv/groups.py``): its kind, its window, and the blocks
    its tables hold now. The groups share the pool's blocks: a group has no size of its own, it takes
    what its sequences need (a sliding group at most about W / block_size blocks per sequence)."""

    group: int
    kind: str  # "full" or "sliding"
    window: int | None  # tokens a sliding group's query sees; None for full attention
    num_layers: int  # model layers in the group's slots
    blocks_in_use: int  # distinct device blocks its tables hold (a shared block counted once)


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int  # sequences in the running batch
    num_requests_waiting: int  # sequences queued (new, preempted or waiting for a lower-tier load)
    kv_cache_usage: float  # fraction of device blocks referenced by running sequences, in [0, 1]
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (all tiers)
    prefix_cache_hits: int  # of those, tokens served from some tier instead of computed
    num_preemptions: dict[str, int]  # by mode: {"swap": ..., "recompute": ...}
    prompt_tokens: int  # prompt tokens of admitted requests
    generation_tokens: int  # tokens sampled
    tiers: dict[Medium, TierSnapshot] = field(default_factory=dict)  # the tiers the engine has
    # kvtier/insight: canary checks by (result, tier), and the miss-ratio curves' estimated hit ratio
    # by (tier, size factor) (refreshed at most once a second).
    canary_checks: dict[tuple[str, str], int] = field(default_factory=dict)
    mrc_hit_ratio: dict[tuple[str, float], float] = field(default_factory=dict)
    kv_dtype: str = "float32"  # what a KV block stores (float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8)
    kv_block_bytes: int = 0  # bytes of one block in every tier, scales included
    running_cap: int = 0  # most sequences the running batch may hold now (kvtier/scheduler/goodput.py)
    num_seqs_waiting: int = 0  # sequences waiting to start, a prompt that forks into n counting n
    # admission by KV capacity (kvtier/scheduler/admission.py; 0 when it is off): the blocks running and
    # waiting requests still need at most, and the demand above which a new request is refused
    kv_demand_blocks: int = 0
    kv_admission_limit_blocks: int = 0
    kv_groups: tuple[KVGroupUsage, ...] = ()  # the device pool by KV group (one for a dense model)
    # prompt-cache retention (kvtier/kv/retention.py): keys retained now, and the prompt tokens of
    # requests asking for retention that were served from the cache within what they retained
    retained_keys: int = 0
    retained_hit_tokens: int = 0

    @property
    def kv_capacity_tokens(self) -> dict[Medium, int]:
        """Tokens each tier holds at this KV dtype: its capacity in blocks x tokens per block."""
        return {m: t.capacity_blocks * t.block_size for m, t in self.tiers.items()}
