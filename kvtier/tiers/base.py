"""The tier contract: what every KV tier below the device pool implements.

Tiers are ordered by speed; a block lives in one or more of them::

    device pool (L1, kv/block_pool.py)  ──store──►  host (L2)  ──demote──►  disk (L3)  ──►  remote (later)
              ◄──────────────load─────────────────   ◄──────────promote──────────

A lower tier is keyed by :data:`BlockKey`, the block's chained sha256 hash. The chain is rooted in
the model fingerprint, the KV dtype and the request's cache salt (``kv/hashing.py``), so a key names
the same bytes in every process, after a restart, and on every replica that shares a remote store.

Every operation is two-phase, like vLLM's offload manager, so that the bookkeeping (here, on the
scheduler's thread) is separate from the bytes moving (``kvtier/transfer``, maybe asynchronously)::

    n    = tier.lookup(keys)               # how many leading keys are held and complete
    spec = tier.prepare_load(keys)         # pins them: not evicted until complete_load
    ...  the transfer layer copies from spec's addresses ...
    tier.complete_load(keys)

    spec = tier.prepare_store(keys)        # reserves room for the keys not held yet (evicting LRU
    ...  the transfer layer copies into spec's addresses ...     blocks: spec.evicted)
    tier.complete_store(spec.keys, ok)     # now visible to lookup (or dropped if not ok)

Addresses are tier-specific (host: slot indices into one pinned buffer; disk: file paths; remote:
object names); only the transfer layer, routed by (source medium, destination medium), reads them.
Nothing here imports torch: the scheduler side tests on CPU without it.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.kv.hashing import BlockHash

BlockKey = BlockHash
"""The key of a block in every tier: 32 bytes, globally unique for (model, dtype, salt, tokens)."""


class Medium(enum.Enum):
    """Where a block's bytes live, fastest first."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


@dataclass(frozen=True)
class TierIdentity:
    """What a stored block's bytes mean. A persistent tier refuses blocks of another identity."""

    model_fingerprint: str
    dtype: str  # "float32", "bfloat16", "float16"
    block_shape: tuple[int, ...]  # [num_layers, block_size, 2, num_kv_heads, head_dim]
    element_size: int  # bytes per element of dtype

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.element_size


@dataclass
class TierStats:
    """Counters since the tier was created. Lookups and hits are counted in blocks."""

    lookups: int = 0
    hit_blocks: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_stored: int = 0
    bytes_stored: int = 0
    store_seconds: float = 0.0
    blocks_evicted: int = 0
    load_failures: int = 0  # a held key that could not be read (corrupt file, I/O error): a miss


@dataclass(frozen=True)
class LoadSpec:
    """Where to read ``keys`` from; ``addresses[i]`` belongs to ``keys[i]``."""

    keys: tuple[BlockKey, ...]
    addresses: tuple[object, ...]


@dataclass(frozen=True)
class StoreSpec:
    """Where to write the accepted ``keys`` (those the tier did not hold yet) and what made room."""

    keys: tuple[BlockKey, ...]
    addresses: tuple[object, ...]
    evicted: tuple[BlockKey, ...] = field(default=())


class KVTier(ABC):
    """One lower tier. All methods are called from one thread (the scheduler's)."""

    medium: Medium
    stats: TierStats

    @property
    @abstractmethod
    def capacity_blocks(self) -> int: ...

    @property
    @abstractmethod
    def num_used_blocks(self) -> int:
        """Blocks held or reserved."""

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.capacity_blocks if self.capacity_blocks else 0.0

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Held and complete (a store in flight is not yet contained). Does not count as a lookup."""

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are held; counts lookups and hits."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        self.stats.lookups += len(keys)
        self.stats.hit_blocks += n
        return n

    @abstractmethod
    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadSpec:
        """Pin ``keys`` (all must be contained) until ``complete_load``; returns their addresses."""

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        """Unpin; each key becomes the most recently used."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[BlockKey]) -> StoreSpec:
        """Reserve room for the keys not held yet, evicting unpinned LRU blocks. Keys that do not
        fit (everything pinned) are left out of the spec."""

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True) -> None:
        """Publish the stored keys (``ok``) or release their reservation."""
