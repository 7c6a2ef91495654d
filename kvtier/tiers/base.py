"""The tier contract: what every KV tier below the device pool implements.

Tiers are ordered by speed; a block lives in one or more of them::

    device pool (L1, kv/block_pool.py)  ──store──►  host (L2)  ──demote──►  disk (L3), remote (L4)
              ◄──────────────load─────────────────   ◄──────────promote──────────

A lower tier is keyed by :data:`BlockKey`, the block's chained sha256 hash. The chain is rooted in
the model fingerprint, the KV dtype and the request's cache salt (``kv/hashing.py``), so a key names
the same bytes in every process, after a restart, and on every replica that shares a remote store.

Every operation is two-phase, like vLLM's offload manager, so that the bookkeeping (here, on the
scheduler's thread) is separate from the bytes moving (``kvtier/transfer``, maybe asynchronously)::

    n    = tier.lookup(keys)               # how many leading keys are held and complete (counts nothing)
    spec = tier.prepare_load(keys)         # pins them: not evicted until complete_load
    ...  the transfer layer copies from spec's addresses ...
    tier.complete_load(keys)

    spec = tier.prepare_store(keys)        # reserves room for the keys not held yet (evicting LRU
    ...  the transfer layer copies into spec's addresses ...     blocks: spec.evicted)
    tier.complete_store(spec.keys, ok)     # now visible to lookup (or dropped if not ok)

Addresses are tier-specific (host: block ids in one pinned buffer; disk: file paths; remote: object
names); only the transfer layer, routed by (source medium, destination medium), reads them.

**KV groups** (a hybrid model, ``kvtier/kv/groups.py``): group ``g``'s block ``i`` is keyed
``group_key(h_i, g)``, so every tier sees one flat key space. A tier still knows each key's group: the
caller names it when it reserves room (``prepare_store(keys, groups)``) and when it asks for a key the
tier may adopt from outside (``lookup(keys, group)``: a file another engine wrote, an entry found in a
shared store). The tier tells its listener the group with every announcement and writes it into the
block header of a persistent tier, whose reader refuses a block of another group than the one it loads
for (``kvtier/tiers/block_format.py``). Group 0, the only group of a dense model, is the default
everywhere; only keys of the other groups are remembered (``_key_groups``, dropped with the key).

Each tier owns one :class:`~kvtier.stats.TierCounters` record (``tier.counters``) and updates it when
its own loads and stores complete; ``snapshot`` hands a copy to ``LLMEngine.stats()``.
Nothing here imports torch: the scheduler side tests on CPU without it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.kv.hashing import BlockHash
from kvtier.kv.lower import BlockListener, KeyGroups, runs_by_group  # declared in kv/ (the pool uses them)
from kvtier.stats import Medium, TierCounters, TierSnapshot

BlockKey = BlockHash
"""The key of a block in every tier: 32 bytes, globally unique for (model, dtype, salt, tokens)."""


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
    """One lower tier. All methods are called from one thread (the scheduler's).

    A tier tells its ``listener`` (if any) when blocks become visible to lookups (``_announce_stored``)
    and when they stop being (``_announce_removed``): stored, evicted, invalidated, dropped; each
    announcement names the keys' KV group (one call per run of one group)."""

    medium: Medium
    counters: TierCounters
    listener: BlockListener | None = None
    # The KV group of each held or reserved key of a group other than 0 (the default). Written only by
    # the methods below: noted when a key is reserved or adopted, dropped when it is removed or released.
    _key_groups: dict[BlockKey, int]

    def group_of(self, key: BlockKey) -> int:
        """The KV group of a key the tier holds or reserves (0 for any other key)."""
        return self._key_groups.get(key, 0)

    def runs_by_group(self, keys: Sequence[BlockKey]) -> list[tuple[int, Sequence[BlockKey]]]:
        """``keys`` (held by this tier) in runs of one KV group, in order: what an announcement names."""
        return runs_by_group(keys, self._key_groups)

    def _note_groups(
        self, keys: Sequence[BlockKey], groups: KeyGroups, accepted: Sequence[BlockKey] | None = None
    ) -> None:
        """Remember the groups (parallel to ``keys``; () = all group 0) of the keys just reserved or
        adopted: ``accepted`` (default: all of ``keys``)."""
        if not any(groups):
            return  # all group 0: nothing to remember (a dense model's every store)
        wanted = None if accepted is None else set(accepted)
        for key, group in zip(keys, groups, strict=True):
            if group and (wanted is None or key in wanted):
                self._key_groups[key] = group

    def _forget_groups(self, keys: Sequence[BlockKey]) -> None:
        """The tier no longer holds or reserves ``keys`` (removed, or a reservation released)."""
        if self._key_groups:
            for key in keys:
                self._key_groups.pop(key, None)

    def _announce_stored(self, keys: Sequence[BlockKey]) -> None:
        if self.listener is not None and keys:
            for group, run in self.runs_by_group(keys):
                self.listener.blocks_stored(self.medium, run, group)

    def _announce_removed(self, keys: Sequence[BlockKey]) -> None:
        """Announce ``keys`` removed and forget their groups (every removal is announced)."""
        if self.listener is not None and keys:
            for group, run in self.runs_by_group(keys):
                self.listener.blocks_removed(self.medium, run, group)
        self._forget_groups(keys)

    def held_keys(self) -> list[BlockKey] | None:
        """The keys visible to lookup (what ``_announce_stored`` announced and ``_announce_removed`` did
        not take back), for the ``GET /v1/kv/blocks`` snapshot. None: the tier cannot list them (a
        shared remote store), and the snapshot leaves its medium out."""
        return None

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
    def contains(self, key: BlockKey, group: int = 0) -> bool:
        """Held and complete (a store in flight is not yet contained). Does not count as a lookup.
        ``group``: the key's KV group, for a tier that may adopt the key from outside."""

    def lookup(self, keys: Sequence[BlockKey], group: int = 0) -> int:
        """How many leading ``keys`` (of KV group ``group``) are held. Counts nothing: the coordinator
        counts the lookups of the hits the scheduler adopts (a held-back request is looked up again
        every step). A tier that adopts blocks from outside (the disk: another engine's files) takes
        ``group`` as theirs; its reader checks it against the block's header."""
        n = 0
        for key in keys:
            if not self.contains(key, group):
                break
            n += 1
        return n

    def snapshot(self, block_size: int) -> TierSnapshot:
        """A copy of the counters with the current occupancy (and the keys it protects for retention)."""
        snap = TierSnapshot.of(
            self.medium, self.counters, self.capacity_blocks, self.num_used_blocks, block_size
        )
        snap.retained_blocks = self.num_retained_blocks()
        return snap

    def num_retained_blocks(self) -> int:
        """Blocks held under prompt-cache retention now (kvtier/kv/retention.py). Default: none."""
        return 0

    @abstractmethod
    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadSpec:
        """Pin ``keys`` (all must be contained) until ``complete_load``; returns their addresses."""

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        """Unpin; each key becomes the most recently used."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[BlockKey], groups: KeyGroups = ()) -> StoreSpec:
        """Reserve room for the keys not held yet, evicting unpinned LRU blocks; ``groups`` (parallel
        to ``keys``; () = all group 0) are their KV groups. Keys that do not fit (everything pinned)
        are left out of the spec."""

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True) -> None:
        """Publish the stored keys (``ok``) or release their reservation."""


class ExternalTier(KVTier):
    """A tier whose bytes live outside the process (disk, a remote store): staged through the host
    tier, moved by a background worker, and able to fail as a whole.

    It counts its own traffic as reads and writes complete (``seconds`` is the worker's time), forgets
    a block that turned out unreadable (``invalidate``), and turns itself off after a fatal error
    (``disable``): a disabled tier holds nothing and accepts nothing."""

    disabled: bool
    identity: TierIdentity

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockKey], seconds: float = 0.0) -> None: ...

    def _finish_loads(
        self, keys: Sequence[BlockKey], held: dict[BlockKey, None], pins: Counter[BlockKey], seconds: float
    ) -> None:
        """Unpin ``keys``; those still ``held`` (not invalidated meanwhile) were read, in ``seconds``:
        count them and make them the most recently used (``held`` is in LRU order)."""
        num_loaded = 0
        for key in keys:
            if pins[key] > 1:
                pins[key] -= 1
            else:
                pins.pop(key, None)
            if key in held:
                held[key] = held.pop(key)  # to the end: most recently used
                num_loaded += 1
        if num_loaded:
            self.counters.record_loads(num_loaded, num_loaded * self.identity.block_bytes, seconds)

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True, seconds: float = 0.0) -> None: ...

    @abstractmethod
    def invalidate(self, key: BlockKey, reason: str) -> None:
        """A read found the block unusable: forget it (and remove it where that is safe)."""

    @abstractmethod
    def disable(self, reason: str) -> None:
        """Stop using the tier (logged once)."""

    @property
    def accepting(self) -> bool:
        """Whether stores are worth preparing now (a tier behind a circuit breaker: not while open)."""
        return not self.disabled

    def tick(self) -> None:
        """Periodic upkeep, called once per engine step (``TierCoordinator.poll``). Default: nothing."""

    def check_store(self) -> None:
        """Ask a shared store whether it restarted empty while this engine had nothing to ask it (an
        idle replica calls this every ``UPKEEP_S``, ``LLMEngine.settle_tiers``); the next ``tick`` then
        forgets what it held. Default: nothing (a local tier)."""

    def close(self) -> None:
        """Release what the tier holds outside its bookkeeping (connections, threads); after the
        worker has finished. Default: nothing."""
