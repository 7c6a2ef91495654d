"""What the KV manager needs from the tiers below the device pool, declared here so that ``kv/``
never imports ``tiers/`` (``kvtier.tiers.coordinator.TierCoordinator`` implements it).

The manager drives the lower tiers at four moments::

    lookup(keys) ─► LowerHit          after the device pool misses: which following blocks the host
                                      tier holds (load them this step) and how many more are on
                                      their way up from disk or a remote store
    hold / load / start_loads         adopting a hit: pin the host blocks, plan their loads, and let
                                      them start at once (ahead of the rest of the step)
    on_device_evict / on_block_full   a cached device block is being reused / a block became full:
                                      the write policy decides whether to plan a store
    write_back                        idle: a store planned ahead of a cached block's eviction
    swap_out / swap_in / release      preemption by swap
    take_plan() ─► SwapPlan           the rest of the step's device↔host copies, once per scheduler step

KV groups (a hybrid model, ``groups.py``): every call that names a block names its group too (default
0, a dense model's only group): the tiers write it into the headers of the blocks they persist, check
it when they read one back, and tell it to the KV events' listener.

Torch-free bookkeeping; the bytes move in ``kvtier/transfer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.kv.hashing import BlockHash
from kvtier.kv.plan import SwapPlan
from kvtier.stats import Medium


@dataclass(frozen=True)
class LowerHit:
    """Where the blocks after the device hits live. ``host_keys`` can be loaded this step; some of
    them were promoted into the host tier from a lower one for this prefix (``promoted``, blocks per
    medium). ``num_pending_blocks`` more are being read up into the host tier."""

    host_keys: tuple[BlockHash, ...] = ()
    promoted: tuple[tuple[Medium, int], ...] = ()
    num_pending_blocks: int = 0
    # The tier each of ``host_keys`` came from (HOST, or the one it was promoted from); () = all HOST.
    sources: tuple[Medium, ...] = ()

    def source_of(self, i: int) -> Medium:
        """The tier whose bytes ``host_keys[i]`` are (what the canary blames on a mismatch)."""
        return self.sources[i] if self.sources else Medium.HOST

    def blocks_by_tier(self) -> dict[Medium, int]:
        """``host_keys`` by the tier that served them."""
        by_tier = {Medium.HOST: len(self.host_keys) - sum(n for _, n in self.promoted)}
        by_tier.update(self.promoted)
        return by_tier


NO_LOWER_HIT = LowerHit()

KeyGroups = Sequence[int]
"""The KV groups of a run of keys, parallel to it; ``()``: every key is group 0 (a dense model)."""


def runs_by_group(
    keys: Sequence[BlockHash], groups: Mapping[BlockHash, int]
) -> list[tuple[int, Sequence[BlockHash]]]:
    """``keys`` split into runs of one KV group, in order (``groups``: a key's group, absent = 0)."""
    if not groups:
        return [(0, keys)]
    runs: list[tuple[int, list[BlockHash]]] = []
    for key in keys:
        group = groups.get(key, 0)
        if runs and runs[-1][0] == group:
            runs[-1][1].append(key)
        else:
            runs.append((group, [key]))
    return [(group, run) for group, run in runs]


class CachedBlock(Protocol):
    """A device block holding cached KV, as the tiers read it (``kvtier.kv.block_pool.KVBlock``)."""

    block_id: int
    block_hash: BlockHash | None  # set: the block is cached
    group: int  # the KV group whose key ``block_hash`` is
    cold: bool  # freed out of a sliding window


@dataclass
class SwappedOut:
    """A sequence preempted by swap: its blocks in order, pinned in the host tier."""

    keys: list[BlockHash]
    private_keys: set[BlockHash]  # blocks without a prefix-cache hash (partial or uncached)


class BlockListener(Protocol):
    """Told which blocks a medium now holds or no longer holds (KV events for a cache-aware router,
    ``kvtier/kv_events.py``), all of KV group ``group`` (their keys are that group's). The device pool
    (through ``KVCacheManager.listener``) and every tier below it (``KVTier.listener``) call it on the
    scheduler's thread; it must not block."""

    def blocks_stored(self, medium: Medium, keys: Sequence[BlockHash], group: int = 0) -> None: ...
    def blocks_removed(self, medium: Medium, keys: Sequence[BlockHash], group: int = 0) -> None: ...


class LowerTiers(Protocol):
    def lookup(self, keys: Sequence[BlockHash], group: int = 0) -> LowerHit:
        """Leading ``keys`` (all of KV group ``group``) held below the device (may start reads from
        slower tiers, which check each block's group)."""

    def num_host_hits(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` the host tier holds now (a pure lookup: starts and counts nothing)."""

    def count_lookup(self, hit: LowerHit, num_keys: int) -> None:
        """Count an adopted lookup of ``num_keys`` blocks below the device."""

    def can_load(self, keys: Sequence[BlockHash]) -> bool:
        """Whether every key is still in the host tier (nothing evicted it since the lookup)."""

    def hold(self, keys: Sequence[BlockHash]) -> None:
        """Pin host hits between the lookup and the device allocation; ``load`` takes the pin over."""

    def unhold(self, keys: Sequence[BlockHash]) -> None:
        """Drop pins ``hold`` took that no ``load`` took over."""

    def load(self, keys: Sequence[BlockHash], device_block_ids: Sequence[int]) -> list[int]:
        """Plan host → device loads of held ``keys`` into the fresh ``device_block_ids``, which it may
        pair in another order; returns the device block of each key."""

    def on_device_evict(self, blocks: Sequence[CachedBlock]) -> None:
        """Cached device blocks are about to be reused for other KV (one allocation's, in eviction
        order); a ``cold`` one (a sliding group's, out of its sequence's window) is kept below only
        where it displaces nothing."""

    def write_back(self, block_id: int, key: BlockHash, group: int = 0, cold: bool = False) -> bool:
        """Ahead of its eviction (the engine idles): plan the store that evicting this cached device
        block would plan; whether one was planned (False: the host tier holds it, or nothing takes it)."""

    def on_window_passed(self, keys: Sequence[BlockHash]) -> None:
        """A sequence's sliding window moved past these blocks: copies below (loaded for an earlier turn)
        are as cold as the device's, first in line for eviction."""

    def on_block_full(self, block_id: int, key: BlockHash, group: int = 0) -> None:
        """A device block of KV group ``group`` became full and computed (and entered the hash map)."""

    def swap_out(
        self, blocks: Sequence[tuple[int, BlockHash | None]], groups: KeyGroups = ()
    ) -> SwappedOut | None:
        """Plan stores that keep ``(device_block_id, hash or None)`` blocks (of KV ``groups``, parallel;
        () = all group 0) pinned in the host tier; None (nothing planned) when the host tier has no room."""

    def swap_in(self, swapped: SwappedOut, device_block_ids: Sequence[int]) -> list[int]:
        """Plan the loads that bring a swapped-out sequence back into the fresh ``device_block_ids``,
        which it may pair in another order; returns the device block of each of its keys."""

    def release(self, swapped: SwappedOut) -> None:
        """A swapped-out sequence ended without resuming: unpin and drop its private blocks."""

    def start_loads(self) -> None:
        """The loads just planned may start now (with the stores planned before them), ahead of the
        step's end; a no-op for tiers that run every copy at ``take_plan``."""

    def take_plan(self) -> SwapPlan:
        """The device↔host copies planned since the last call."""

    @property
    def num_planned_loads(self) -> int:
        """Host → device loads planned since the last ``take_plan`` (the step's budget charges them)."""

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the tiers' books do not balance."""
