"""``TierCoordinator``: the tiers below the device pool, in order, and the policy between them.

It answers "where does the rest of this prefix live?" tier by tier and turns the answers into
work::

    KVCacheManager ──lookup(keys)──────────► host hits (load now) · disk hits (read into host first)
                   ──on_device_evict──────► write-back store: device block → host slot
                   ──on_block_full────────► write-through store (policy "write_through")
                   ──load / swap_out / swap_in ─► host pins and slots
                   ◄──take_plan()────────── the step's SwapPlan (device↔host copies)

    host eviction ──► demote to disk (if the disk tier lacks the block): the mover snapshots the
                      slot at once and a background thread writes the file
    disk hit      ──► promote: a background read into a reserved host slot; the block becomes a host
                      hit when the read completes (poll), and the scheduler holds the request back
                      until then or until its deadline, after which the rest is computed instead

Bookkeeping only (torch-free); bytes move through a :class:`BlockMover` (``kvtier/transfer``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.config import StorePolicy
from kvtier.tiers.base import BlockKey
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.plan import SwapPlan

log = logging.getLogger("kvtier.tiers")


class IOResultLike(Protocol):
    kind: str  # "load" | "store"
    key: BlockKey
    ok: bool
    error: str | None
    fatal: bool
    nbytes: int
    seconds: float


class BlockMover(Protocol):
    """The data path the coordinator drives for disk traffic (``kvtier.transfer.mover``)."""

    def start_disk_load(self, key: BlockKey, path: str, host_slot: int) -> None: ...
    def start_disk_store(self, key: BlockKey, path: str, host_slot: int) -> None: ...
    def poll_io(self) -> Sequence[IOResultLike]: ...
    def wait_io(self, timeout: float) -> Sequence[IOResultLike]: ...
    def drain_io(self, timeout: float) -> Sequence[IOResultLike]: ...


@dataclass(frozen=True)
class LowerHit:
    """Where the blocks after the device hits live: ``host_keys`` can be loaded this step;
    ``num_pending_blocks`` more are on disk, being read into the host tier."""

    host_keys: tuple[BlockKey, ...] = ()
    num_from_disk: int = 0  # of host_keys, blocks that were promoted from disk for this prefix
    num_pending_blocks: int = 0


NO_LOWER_HIT = LowerHit()


@dataclass
class SwappedOut:
    """A sequence preempted by swap: its blocks in order, pinned in the host tier."""

    keys: list[BlockKey]
    private_keys: set[BlockKey]  # blocks without a prefix-cache hash (partial or uncached)


class TierCoordinator:
    def __init__(self, host: HostTier, disk: DiskTier | None = None, policy: StorePolicy = "write_back"):
        if policy not in ("write_back", "write_through"):
            raise ValueError(f"kv_store_policy must be write_back or write_through, got {policy!r}")
        self.host = host
        self.disk = disk
        self.policy = policy
        self.mover: BlockMover | None = None  # attached by the engine before the first step
        host.on_evict = self._host_evicted
        self._plan = SwapPlan()
        self._promoting: set[BlockKey] = set()  # disk → host reads in flight
        self._from_disk: set[BlockKey] = set()  # host keys promoted from disk, not loaded yet
        self._disk_storing: set[BlockKey] = set()  # host → disk writes in flight
        self._swap_ids = itertools.count()
        self._private: set[BlockKey] = set()  # keys of swapped-out sequences' private blocks

    @property
    def disk_active(self) -> bool:
        return self.disk is not None and not self.disk.disabled and self.mover is not None

    @property
    def has_pending_io(self) -> bool:
        return bool(self._promoting or self._disk_storing)

    # ------------------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[BlockKey]) -> LowerHit:
        """Leading ``keys`` held by the host tier, then by disk (starting their promotion)."""
        if not keys:
            return NO_LOWER_HIT
        n_host = 0
        for key in keys:
            if not self.host.contains(key):
                break
            n_host += 1
        host_keys = tuple(keys[:n_host])
        num_from_disk = sum(1 for k in host_keys if k in self._from_disk)
        rest = keys[n_host:]
        if not rest or not self.disk_active:
            return LowerHit(host_keys, num_from_disk, 0)
        assert self.disk is not None
        num_pending = 0
        to_read: list[BlockKey] = []
        for key in rest:
            if key in self._promoting or key in self._disk_storing:  # read (after the write) soon
                num_pending += 1
            elif self.disk.contains(key):
                num_pending += 1
                to_read.append(key)
            else:
                break
        if to_read:
            self.host.pin(host_keys)  # the reservation below must not evict this prefix's host hits
            try:
                self._promote(to_read)
            finally:
                self.host.unpin(host_keys)
            # Only blocks actually on their way count: the host tier may have had no room for all.
            num_pending = 0
            for key in rest:
                if key not in self._promoting and key not in self._disk_storing:
                    break
                num_pending += 1
        return LowerHit(host_keys, num_from_disk, num_pending)

    def count_lookup(self, hit: LowerHit, num_keys: int) -> None:
        """Count an adopted lookup of ``num_keys`` blocks below the device: each block is counted by
        the first tier that was asked for it and, on a hit, by the tier that served it."""
        n_host = len(hit.host_keys) - hit.num_from_disk
        self.host.stats.lookups += num_keys
        self.host.stats.hit_blocks += n_host
        if self.disk is not None:
            self.disk.stats.lookups += num_keys - n_host
            self.disk.stats.hit_blocks += hit.num_from_disk

    def _promote(self, keys: list[BlockKey]) -> None:
        assert self.disk is not None and self.mover is not None
        spec = self.host.prepare_store(keys)
        if not spec.keys:
            return
        load = self.disk.prepare_load(spec.keys)
        for key, slot, path in zip(spec.keys, spec.addresses, load.addresses, strict=True):
            self._promoting.add(key)
            self.mover.start_disk_load(key, str(path), int(slot))  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------ loads and stores
    def hold(self, keys: Sequence[BlockKey]) -> None:
        """Pin host hits between the lookup and the device allocation (which may evict in the host
        tier through write-back stores); ``load`` takes the pin over."""
        self.host.pin(keys)

    def load(self, keys: Sequence[BlockKey], device_block_ids: Sequence[int]) -> None:
        """Plan host → device loads of ``keys``, which the caller pinned (``hold`` or ``swap_out``)."""
        spec = self.host.prepare_load(keys)
        self.host.unpin(keys)
        for key, slot, block_id in zip(keys, spec.addresses, device_block_ids, strict=True):
            self._plan.loads.append((int(slot), block_id))  # type: ignore[call-overload]
            self._plan.load_keys.append(key)
        self._from_disk.difference_update(keys)

    def store(self, block_id: int, key: BlockKey) -> bool:
        """Plan a device → host store of one block unless the host tier has (or is getting) it."""
        if self.host.slot_of(key) is not None:
            return False
        spec = self.host.prepare_store([key])
        if not spec.keys:
            return False  # the host tier is full of pinned blocks: the block is dropped
        self._plan.stores.append((block_id, int(spec.addresses[0])))  # type: ignore[call-overload]
        self._plan.store_keys.append(key)
        return True

    def on_device_evict(self, block_id: int, key: BlockKey) -> None:
        """Write-back: a cached device block is about to be reused; keep its KV in the host tier."""
        self.store(block_id, key)

    def on_block_full(self, block_id: int, key: BlockKey) -> None:
        if self.policy == "write_through":
            self.store(block_id, key)

    def take_plan(self) -> SwapPlan:
        plan, self._plan = self._plan, SwapPlan()
        return plan

    def complete_plan(self, plan: SwapPlan) -> None:
        """The plan's copies have run: publish stored keys, unpin loaded ones, drop private ones."""
        self.host.complete_store(plan.store_keys)
        self.host.complete_load(plan.load_keys)
        self.host.discard(plan.discard_keys)
        if self.policy == "write_through" and self.disk_active:
            self._store_to_disk([k for k in plan.store_keys if k not in self._private])

    # ------------------------------------------------------------------------------ swap
    def swap_out(self, blocks: Sequence[tuple[int, BlockKey | None]]) -> SwappedOut | None:
        """Plan the stores that keep a preempted sequence's blocks ``(device_block_id, hash or None)``
        in the host tier, pinned. None (and nothing planned) if the host tier has no room."""
        keys = [key if key is not None else self._private_key() for _, key in blocks]
        private = {k for (_, h), k in zip(blocks, keys, strict=True) if h is None}
        needed = [(b, k) for (b, _), k in zip(blocks, keys, strict=True) if self.host.slot_of(k) is None]
        present = [k for k in keys if self.host.slot_of(k) is not None]
        self.host.pin(present)  # making room for the others must not evict these
        spec = self.host.prepare_store([k for _, k in needed])
        if len(spec.keys) != len(needed):
            self.host.complete_store(spec.keys, ok=False)
            self.host.unpin(present)
            self._private.difference_update(private)
            return None
        self.host.pin(spec.keys)
        for (block_id, key), slot in zip(needed, spec.addresses, strict=True):
            self._plan.stores.append((block_id, int(slot)))  # type: ignore[call-overload]
            self._plan.store_keys.append(key)
        return SwappedOut(keys, private)

    def swap_in(self, swapped: SwappedOut, device_block_ids: Sequence[int]) -> None:
        """Plan the loads that bring a swapped-out sequence back; its pins pass to the loads."""
        self.load(swapped.keys, device_block_ids)
        self._plan.discard_keys.extend(swapped.private_keys)
        self._private.difference_update(swapped.private_keys)

    def release(self, swapped: SwappedOut) -> None:
        """A swapped-out sequence finished without resuming (abort): unpin, drop private blocks."""
        self.host.unpin(swapped.keys)
        self.host.discard(swapped.private_keys)
        self._private.difference_update(swapped.private_keys)

    def _private_key(self) -> BlockKey:
        """A key no prefix can ever look up: private blocks are never stored below the host tier."""
        key = BlockKey(
            hashlib.sha256(b"kvtier-swap-v1" + next(self._swap_ids).to_bytes(8, "little")).digest()
        )
        self._private.add(key)
        return key

    # ------------------------------------------------------------------------------ disk
    def _host_evicted(self, key: BlockKey, slot: int) -> None:
        self._from_disk.discard(key)
        if self.disk_active and key not in self._private:
            self._store_to_disk([key], {key: slot})

    def _store_to_disk(self, keys: Sequence[BlockKey], slots: dict[BlockKey, int] | None = None) -> None:
        assert self.disk is not None and self.mover is not None
        keys = [k for k in keys if k not in self._disk_storing and not self.disk.contains(k)]
        if not keys:
            return
        spec = self.disk.prepare_store(keys)
        for key, path in zip(spec.keys, spec.addresses, strict=True):
            slot = slots[key] if slots else self.host.slot_of(key)
            assert slot is not None
            self._disk_storing.add(key)
            self.mover.start_disk_store(key, str(path), slot)

    def poll(self, results: Sequence[IOResultLike] | None = None) -> None:
        """Apply finished disk reads and writes (from ``mover.poll_io()`` unless given)."""
        if self.mover is None:
            return
        for r in self.mover.poll_io() if results is None else results:
            self._apply(r)

    def wait(self, timeout: float) -> None:
        """Block until some disk I/O finishes (or ``timeout``): used when nothing else can run."""
        if self.mover is not None and self.has_pending_io:
            for r in self.mover.wait_io(timeout):
                self._apply(r)

    def flush(self, timeout: float = 60.0) -> None:
        """Write every held host block to disk and wait (engine shutdown: a restart finds them)."""
        if self.mover is None:
            return
        if self.disk_active:
            self._store_to_disk([k for k in self.host.held_keys() if k not in self._private])
        for r in self.mover.drain_io(timeout):
            self._apply(r)

    def _apply(self, r: IOResultLike) -> None:
        disk = self.disk
        assert disk is not None
        if r.kind == "load":
            self._promoting.discard(r.key)
            self.host.complete_store([r.key], ok=r.ok)
            if r.ok:
                self._from_disk.add(r.key)
                disk.complete_load([r.key])  # counts blocks and bytes loaded
                disk.stats.load_seconds += r.seconds
            else:
                disk.invalidate(r.key, r.error or "unreadable")  # drops the pin, removes the file
        else:
            self._disk_storing.discard(r.key)
            disk.complete_store([r.key], ok=r.ok)  # counts blocks and bytes stored
            if r.ok:
                disk.stats.store_seconds += r.seconds
            elif r.fatal and not disk.disabled:
                disk.disable(r.error or "write failed")
