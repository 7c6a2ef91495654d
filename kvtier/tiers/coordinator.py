"""``TierCoordinator``: the tiers below the device pool, in order, and the policy between them.

It answers "where does the rest of this prefix live?" tier by tier and turns the answers into
work (it implements ``kvtier.kv.lower.LowerTiers``, what the KV manager asks of the tiers)::

    KVCacheManager ──lookup(keys)──────────► host hits (load now) · hits further down (read into host)
                   ──on_device_evict──────► write-back store: device block → host block
                   ──on_block_full────────► write-through store (policy "write_through" of the host
                                            tier or of an external tier)
                   ──load / swap_out / swap_in ─► host pins and host blocks
                   ◄──take_plan()────────── the step's SwapPlan (device↔host copies)
    server ─────────publish(keys)────────► disaggregated prefill: how many of a prompt's blocks the
                                            shared tier holds, is getting, or will never get

    host eviction ──► demote to each external tier (disk, ...) that lacks the block: the host bytes
                      are snapshotted at once and the tier's background worker writes them
    no host room  ──► demote: a device block evicted while the host tier is all pinned or reserved (a
                      step loading a long prompt) is snapshotted from the device by the mover and
                      written straight to the first external tier that takes it, not dropped (a
                      cold block, out of a sliding window, only to a disk tier with free room)
    external hit  ──► promote: a background read into a reserved host block; the block becomes a host
                      hit when the read completes (poll), and the scheduler holds the request back
                      until then or until its deadline, after which the rest is computed instead

External tiers (``ExternalTier`` + a ``BlockIOWorker``) are tried in the order given, fastest first; each
has a write policy: ``write_through`` writes a block down as soon as it reaches the host tier,
``write_back`` only when the host tier evicts it.

KV groups (a hybrid model): the manager names each block's group (``store``, ``lookup``, ``swap_out``);
the host tier keeps it with the key, a demotion writes it into the block's header, and a promotion reads
the block for the group its lookup asked for (the reader refuses another group's block: a miss).

Bookkeeping only (torch-free): host bytes are reached through a :class:`HostBytes`
(``kvtier.transfer.mover.TierMover``), external bytes through the workers.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvtier.config import StorePolicy, check_choice
from kvtier.kv.lower import NO_LOWER_HIT, BlockListener, CachedBlock, KeyGroups, LowerHit, SwappedOut
from kvtier.kv.plan import Demote, SwapPlan, paired_ids
from kvtier.stats import Medium
from kvtier.tiers.base import BlockKey, KVTier
from kvtier.tiers.external_level import ExternalLevel, HostBytes, IOResultLike, IOWorker, SharedProgress
from kvtier.tiers.host import HostTier
from kvtier.tiers.shared_writes import SharedWrites

__all__ = ["ExternalLevel", "HostBytes", "IOResultLike", "IOWorker", "SharedProgress", "TierCoordinator"]

IO_STALL_S = 5.0
"""At shutdown (``flush``, ``close``), a tier whose worker finishes no read or write for this long is
stuck (a hung disk, a mount gone away): it is turned off with one log line and its daemon thread left
behind, so shutdown never waits on it."""


class TierCoordinator:
    def __init__(
        self,
        host: HostTier,
        external: Sequence[ExternalLevel] = (),
        policy: StorePolicy = "write_back",
    ):
        check_choice("kv_store_policy", policy, StorePolicy)
        self.host = host
        self.external = list(external)
        self.policy = policy  # device → host
        self.host_bytes: HostBytes | None = None  # attached by the engine before the first step
        host.on_evict = self._host_evicted
        self._plan = SwapPlan()
        # Runs a plan's copies at once (the engine's mover): set, loads start as planned (start_loads).
        self.run_now: Callable[[SwapPlan], None] | None = None
        self._loads_run = 0  # loads of this step already handed to ``run_now``
        self._promoted: dict[BlockKey, Medium] = {}  # host keys read up from an external tier, not loaded yet
        self._swap_ids = itertools.count()
        self._private: set[BlockKey] = set()  # keys of swapped-out sequences' private blocks
        self._listener: BlockListener | None = None  # KV events (attach_listener)
        self.shared = SharedWrites(self.external, host, self._private, self._store_down)
        # Tiers the equivalence canary caught serving wrong bytes (kvtier/insight/canary.py): nothing
        # is loaded from them until ``release``. Quarantining HOST stops every load from below the
        # device, since disk and remote blocks are staged through host memory.
        self.quarantined: set[Medium] = set()
        # Told of the blocks each tier stores (from the tier above), for its miss-ratio curve.
        self.on_stored: Callable[[Medium, Sequence[BlockKey]], None] | None = None
        # Told of the blocks offered to each tier (stored unless held): what a simulation of it admits.
        self.on_offered: Callable[[Medium, Sequence[BlockKey]], None] | None = None

    # ------------------------------------------------------------------------------ quarantine
    def quarantine(self, medium: Medium) -> None:
        """Stop loading blocks from ``medium`` (stores go on; lookups no longer find its blocks)."""
        self.quarantined.add(Medium(medium))

    def lift_quarantine(self, medium: Medium) -> bool:
        """Lift a quarantine (an admin call); False if ``medium`` was not quarantined."""
        if Medium(medium) not in self.quarantined:
            return False
        self.quarantined.discard(Medium(medium))
        return True

    @property
    def tiers(self) -> list[KVTier]:
        """Every tier below the device, fastest first."""
        return [self.host, *(level.tier for level in self.external)]

    def tier(self, medium: Medium) -> KVTier | None:
        return next((t for t in self.tiers if t.medium == medium), None)

    @property
    def persists(self) -> bool:
        """Whether some active tier outlives the process (blocks are worth flushing at shutdown)."""
        return any(level.active for level in self.external)

    @property
    def has_pending_io(self) -> bool:
        return any(level.promoting or level.storing for level in self.external)

    @property
    def has_pending_work(self) -> bool:
        """Copies planned for the next step, or reads and writes in flight: an idle engine still has
        tier work (``LLMEngine.settle_tiers``)."""
        return not self._plan.is_empty or self.has_pending_io

    def check_stores(self) -> None:
        """Ask each active shared tier whether its store restarted empty (``ExternalTier.check_store``)."""
        for level in self.external:
            if level.active:
                level.tier.check_store()

    def check_integrity(self) -> None:
        self.host.check_integrity()

    def forget(self, key: BlockKey, reason: str) -> None:
        """Drop ``key`` from every tier that holds it and may be asked again (a canary mismatch)."""
        self._promoted.pop(key, None)
        self.host.discard([key])  # unless pinned by a load in flight: the quarantine covers that
        for level in self.external:
            if level.tier.contains(key) and not level.in_flight(key):
                level.tier.invalidate(key, reason)

    # ------------------------------------------------------------------------------ KV events
    def attach_listener(self, listener: BlockListener) -> None:
        """Tell ``listener`` what every tier holds now (the disk tier's start-up scan), then every change.

        The host tier's listener is this coordinator: it hides the keys of swapped-out sequences'
        private blocks, which no prefix can look up (``_private_key``), so a router never sees them."""
        self._listener = listener
        self.host.listener = self
        for level in self.external:
            level.tier.listener = listener
        held = self.held_keys()
        for tier in self.tiers:
            for group, keys in tier.runs_by_group(held.get(tier.medium, [])):
                listener.blocks_stored(tier.medium, keys, group)

    def blocks_stored(self, medium: Medium, keys: Sequence[BlockKey], group: int = 0) -> None:
        shared = [k for k in keys if k not in self._private]
        if self._listener is not None and shared:
            self._listener.blocks_stored(medium, shared, group)

    def blocks_removed(self, medium: Medium, keys: Sequence[BlockKey], group: int = 0) -> None:
        shared = [k for k in keys if k not in self._private]
        if self._listener is not None and shared:
            self._listener.blocks_removed(medium, shared, group)

    def held_keys(self) -> dict[Medium, list[BlockKey]]:
        """What each tier that can list its blocks holds, as announced to the listener."""
        held = {Medium.HOST: [k for k in self.host.held_keys() if k not in self._private]}
        for level in self.external:
            keys = level.tier.held_keys()
            if keys is not None:
                held[level.tier.medium] = keys
        return held

    # ------------------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[BlockKey], group: int = 0) -> LowerHit:
        """Leading ``keys`` (of KV group ``group``) held by the host tier, then by the external tiers
        (starting their reads, each for ``group``)."""
        if not keys or Medium.HOST in self.quarantined:
            return NO_LOWER_HIT
        n_host = self._num_trusted(keys[: self.host.lookup(keys)])
        host_keys = tuple(keys[:n_host])
        sources = tuple(self._promoted.get(k, Medium.HOST) for k in host_keys)
        promoted = Counter(m for m in sources if m != Medium.HOST)
        rest = keys[n_host:]
        num_pending = 0
        if rest and self.persists:
            self.host.pin(host_keys)  # reserving host blocks below must not evict this prefix's hits
            try:
                self._start_reads(rest, group)
            finally:
                self.host.unpin(host_keys)
            num_pending = self._num_leading_in_flight(rest)
        return LowerHit(host_keys, tuple(sorted(promoted.items())), num_pending, sources)

    def num_host_hits(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the host tier holds now (a pure lookup: the scheduler's estimates)."""
        if not keys or Medium.HOST in self.quarantined:
            return 0
        return self._num_trusted(keys[: self.host.lookup(keys)])

    def _num_trusted(self, host_keys: Sequence[BlockKey]) -> int:
        """How many leading host hits were not promoted from a quarantined tier."""
        if not self.quarantined:
            return len(host_keys)
        for i, key in enumerate(host_keys):
            if self._promoted.get(key) in self.quarantined:
                return i
        return len(host_keys)

    def _num_leading_in_flight(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are on their way into the host tier (or being written, then read)."""
        n = 0
        for key in keys:
            if not any(level.in_flight(key) for level in self.external):
                break
            n += 1
        return n

    def _start_reads(self, keys: Sequence[BlockKey], group: int) -> None:
        """Start reading the leading ``keys`` (KV group ``group``'s) the external tiers hold into the host
        tier, each from the fastest tier holding it. Keys already in flight are skipped; the walk stops
        at the first key no tier holds (a later block is useless without it)."""
        i = 0
        while i < len(keys):
            if any(level.in_flight(keys[i]) for level in self.external):
                i += 1  # read (after the write) soon
                continue
            for level in self.external:
                usable = level.active and level.tier.medium not in self.quarantined
                n = level.tier.lookup(keys[i:], group) if usable else 0
                if n:
                    run = [k for k in keys[i : i + n] if not any(lv.in_flight(k) for lv in self.external)]
                    self._promote(level, run, group)
                    i += n
                    break
            else:
                return

    def _promote(self, level: ExternalLevel, keys: list[BlockKey], group: int) -> None:
        assert self.host_bytes is not None
        spec = self.host.prepare_store(keys, [group] * len(keys))  # the host tier may not have room for all
        if not spec.keys:
            return
        load = level.tier.prepare_load(spec.keys)
        for key, host_block_id, address in zip(spec.keys, spec.addresses, load.addresses, strict=True):
            level.promoting.add(key)
            view = self.host_bytes.host_view(int(host_block_id))  # type: ignore[call-overload]
            level.worker.submit_load(key, address, view, group)

    def count_lookup(self, hit: LowerHit, num_keys: int) -> None:
        """Count an adopted lookup of ``num_keys`` blocks below the device: each block is counted by
        every tier that was asked for it and, on a hit, by the tier that served it."""
        served = hit.blocks_by_tier()
        remaining = num_keys
        for tier in self.tiers:
            tier.counters.lookups += remaining
            n = served.get(tier.medium, 0)
            tier.counters.hit_blocks += n
            remaining -= n

    # ------------------------------------------------------------------------------ loads and stores
    def can_load(self, keys: Sequence[BlockKey]) -> bool:
        return all(self.host.contains(k) for k in keys)

    def hold(self, keys: Sequence[BlockKey]) -> None:
        """Pin host hits between the lookup and the device allocation (which may evict in the host
        tier through write-back stores); ``load`` takes the pin over."""
        self.host.pin(keys)

    def unhold(self, keys: Sequence[BlockKey]) -> None:
        self.host.unpin(keys)

    def load(self, keys: Sequence[BlockKey], device_block_ids: Sequence[int]) -> list[int]:
        """Plan host → device loads of ``keys`` (pinned by ``hold`` or ``swap_out``) into the fresh
        ``device_block_ids``, paired in the host blocks' order (``paired_ids``: no scatter where both
        runs are consecutive). Returns the device block of each key."""
        host_block_ids = self.host.pinned_blocks(keys)  # their pins now carry the load
        paired = paired_ids(host_block_ids, device_block_ids)
        self._plan_loads(keys, host_block_ids, paired)
        return paired

    def _plan_loads(
        self, keys: Sequence[BlockKey], host_block_ids: Sequence[int], device_block_ids: Sequence[int]
    ) -> None:
        self._plan.loads.extend(zip(host_block_ids, device_block_ids, strict=True))
        self._plan.load_keys.extend(keys)
        if self._promoted:
            for key in keys:
                self._promoted.pop(key, None)

    def start_loads(self) -> None:
        """Hand the plan so far (stores, then loads) to ``run_now``: a hit's copies cross the link while
        the rest of the step is scheduled (an 8k hit's first byte waited 3-4 ms of host work on an H200).
        Later plans run after it: on CUDA their streams wait for the compute stream, which waits for
        this plan's copies (``TierMover.execute``)."""
        if self.run_now is None or not self._plan.loads:
            return
        plan, self._plan = self._plan, SwapPlan()
        self._loads_run += len(plan.loads)
        self.run_now(plan)

    def store(self, block_id: int, key: BlockKey, group: int = 0, cold: bool = False) -> bool:
        """Plan a device → host store of one block (of KV group ``group``) unless the host tier has (or
        is getting) it; a ``cold`` block only into free room, first in line for eviction. A block the
        host tier has no room for is demoted straight down (``_demote``)."""
        if self.on_offered is not None:
            self.on_offered(Medium.HOST, [key])
        return self._store(block_id, key, group, cold)

    def _store(self, block_id: int, key: BlockKey, group: int, cold: bool) -> bool:
        if self.host.host_block_of(key) is not None:
            return False
        if self.host.num_used_blocks >= self.host.capacity_blocks and self._safe_below(key, group):
            return False  # a full host tier's room goes to blocks no tier holds (a step's loads pin it)
        spec = self.host.prepare_store([key], [group], cold=cold)
        if not spec.keys:
            return self._demote(block_id, key, group, cold)
        self._plan.stores.append((block_id, int(spec.addresses[0])))  # type: ignore[call-overload]
        self._plan.store_keys.append(key)
        return True

    def _demote(self, block_id: int, key: BlockKey, group: int, cold: bool) -> bool:
        """Plan device block ``block_id`` straight down to the first external tier that takes it (the
        mover snapshots its bytes this step, ``complete_plan`` hands them to the tier's worker); False
        when none does: the block is dropped. A warm block got no host room because the host tier is
        all pinned (a step loading a long prompt); a ``cold`` one (out of a sliding window) goes only
        to a disk tier with free room, where it displaces nothing: a conversation's earlier windows
        stay loadable after a restart (an edited or replayed earlier turn)."""
        for index, level in enumerate(self.external):
            if not level.active or level.tier.medium in self.quarantined or key in level.storing:
                continue
            if cold and (
                level.tier.medium is not Medium.DISK
                or level.tier.num_used_blocks >= level.tier.capacity_blocks
                or level.tier.contains(key, group)
            ):
                continue
            spec = level.tier.prepare_store([key], [group])
            if spec.keys:
                level.storing.add(key)
                self._plan.demotes.append(Demote(block_id, key, group, index, spec.addresses[0]))
                return True
        return False

    def _safe_below(self, key: BlockKey, group: int) -> bool:
        """Whether an external tier in use holds ``key`` (or is writing it)."""
        return any(
            level.active
            and level.tier.medium not in self.quarantined
            and (key in level.storing or level.tier.contains(key, group))
            for level in self.external
        )

    def on_device_evict(self, blocks: Sequence[CachedBlock]) -> None:
        """Write-back: cached device blocks are about to be reused; keep their KV in the host tier (a
        ``cold`` one, out of a sliding window, only where it displaces nothing), in order, the host
        tier offered them in one call."""
        keys = [block.block_hash for block in blocks if block.block_hash is not None]
        assert len(keys) == len(blocks), "an uncached device block cannot be evicted"
        if self.on_offered is not None and keys:
            self.on_offered(Medium.HOST, keys)
        first = len(self._plan.stores)
        if self.persists or any(block.cold for block in blocks):
            for block, key in zip(blocks, keys, strict=True):
                self._store(block.block_id, key, block.group, block.cold)
        else:
            self._store_warm(blocks, keys)
        self._pair_stores(first)

    def _store_warm(self, blocks: Sequence[CachedBlock], keys: list[BlockKey]) -> None:
        """``_store`` of warm ``blocks`` with no external tier in use, in one host reservation (it takes the
        keys as one by one, held ones skipped); a key the host tier cannot take has nowhere else to go:
        dropped, as ``_store`` drops it."""
        first: dict[BlockKey, tuple[int, int]] = {}  # key -> (device block, group), its first block's
        for block, key in zip(blocks, keys, strict=True):
            first.setdefault(key, (block.block_id, block.group))
        spec = self.host.prepare_store(list(first), [group for _, group in first.values()])
        self._plan.stores += [(first[k][0], int(a)) for k, a in zip(spec.keys, spec.addresses, strict=True)]  # type: ignore[call-overload]
        self._plan.store_keys.extend(spec.keys)

    def _pair_stores(self, first: int) -> None:
        """The stores planned from ``first`` on take their fresh host blocks in the device blocks' order
        (``paired_ids``): evicted tail first, they came paired descending, a gather on CUDA."""
        stores = self._plan.stores[first:]
        if len(stores) > 1:
            devices = [device for device, _ in stores]
            hosts = paired_ids(devices, [host for _, host in stores])
            self.host.reassign(self._plan.store_keys[first:], hosts)
            self._plan.stores[first:] = list(zip(devices, hosts, strict=True))

    def write_back(self, block_id: int, key: BlockKey, group: int = 0, cold: bool = False) -> bool:
        """Ahead of eviction (kvtier/kv/write_ahead.py): the store ``on_device_evict`` would plan."""
        return self.host.host_block_of(key) is None and self.store(block_id, key, group, cold)

    def on_window_passed(self, keys: Sequence[BlockKey]) -> None:
        self.host.cool(keys)

    def on_block_full(self, block_id: int, key: BlockKey, group: int = 0) -> None:
        """Write-through: store a block as soon as it is full, if the host tier's policy or an active
        external tier's asks for it (an external tier is written from the host tier, so a write-through
        remote tier needs the block in host memory now, not when the device evicts it)."""
        if self.policy == "write_through" or any(
            level.policy == "write_through" and level.tier.accepting for level in self.external
        ):
            self.store(block_id, key, group)

    @property
    def num_planned_loads(self) -> int:
        """This step's loads so far: those already run (``start_loads``) and those in the plan."""
        return self._loads_run + len(self._plan.loads)

    def take_plan(self) -> SwapPlan:
        """The rest of the step's plan (what ``start_loads`` did not run); the step's count restarts."""
        plan, self._plan = self._plan, SwapPlan()
        self._loads_run = 0
        return plan

    def complete_plan(self, plan: SwapPlan) -> None:
        """The plan's copies have run: publish stored keys, unpin loaded ones, drop private ones, and
        write the new host blocks down to the write-through external tiers."""
        self.host.complete_store(plan.store_keys)
        self.host.complete_load(plan.load_keys)
        self.host.discard(plan.discard_keys)
        shared = [k for k in plan.store_keys if k not in self._private]
        if self.on_stored is not None and shared:
            self.on_stored(Medium.HOST, shared)
        self._private.difference_update(plan.discard_keys)  # private until dropped (KV events hide them)
        for level in self.external:
            if level.policy == "write_through" and level.active:
                self._store_down(level, shared)
        self._submit_demotes(plan.demotes)

    def _submit_demotes(self, demotes: Sequence[Demote]) -> None:
        """Hand the demoted blocks' bytes to their tiers' workers (none: the plan ran without a mover,
        the reservation is given back)."""
        for d in demotes:
            level = self.external[d.level]
            if d.data is None:
                level.storing.discard(d.key)
                level.tier.complete_store([d.key], ok=False)
            else:
                if self.on_offered is not None:
                    self.on_offered(level.tier.medium, [d.key])
                level.worker.submit_store(d.key, d.address, d.data, d.group)

    # ------------------------------------------------------------------------------ swap
    def swap_out(
        self, blocks: Sequence[tuple[int, BlockKey | None]], groups: KeyGroups = ()
    ) -> SwappedOut | None:
        """Plan the stores that keep a preempted sequence's blocks ``(device_block_id, hash or None)``
        (of KV ``groups``, parallel; () = all group 0) in the host tier, pinned. None (and nothing
        planned) if the host tier has no room."""
        keys = [key if key is not None else self._private_key() for _, key in blocks]
        private = {k for (_, h), k in zip(blocks, keys, strict=True) if h is None}
        group_of = dict(zip(keys, groups, strict=True)) if groups else {}
        needed = [
            (b, k) for (b, _), k in zip(blocks, keys, strict=True) if self.host.host_block_of(k) is None
        ]
        present = [k for k in keys if self.host.host_block_of(k) is not None]
        self.host.pin(present)  # making room for the others must not evict these
        spec = self.host.prepare_store([k for _, k in needed], [group_of.get(k, 0) for _, k in needed])
        if len(spec.keys) != len(needed):
            self.host.complete_store(spec.keys, ok=False)
            self.host.unpin(present)
            self._private.difference_update(private)
            return None
        self.host.pin(spec.keys)
        first = len(self._plan.stores)
        for (block_id, key), host_block_id in zip(needed, spec.addresses, strict=True):
            self._plan.stores.append((block_id, int(host_block_id)))  # type: ignore[call-overload]
            self._plan.store_keys.append(key)
        self._pair_stores(first)
        return SwappedOut(keys, private)

    def swap_in(self, swapped: SwappedOut, device_block_ids: Sequence[int]) -> list[int]:
        """Plan the loads that bring a swapped-out sequence back (``load``'s pairing; its pins pass to
        the loads); returns the device block of each of its keys."""
        paired = self.load(swapped.keys, device_block_ids)
        self._plan.discard_keys.extend(swapped.private_keys)
        return paired

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

    # ------------------------------------------------------------------------------ external tiers
    def _host_evicted(self, key: BlockKey, host_block_id: int) -> None:
        self._promoted.pop(key, None)
        if key in self._private:
            return
        for level in self.external:
            if level.active:
                self._store_down(level, [key], {key: host_block_id})

    def _store_down(
        self, level: ExternalLevel, keys: Sequence[BlockKey], host_blocks: dict[BlockKey, int] | None = None
    ) -> None:
        """Write host blocks ``keys`` to an external tier unless it holds (or is getting) them, each
        under the KV group the host tier keeps with it."""
        assert self.host_bytes is not None
        if self.on_offered is not None and keys:
            self.on_offered(level.tier.medium, keys)
        group_of = self.host.group_of
        keys = [k for k in keys if k not in level.storing and not level.tier.contains(k, group_of(k))]
        if not keys:
            return
        spec = level.tier.prepare_store(keys, [group_of(k) for k in keys])
        for key, address in zip(spec.keys, spec.addresses, strict=True):
            host_block_id = host_blocks[key] if host_blocks else self.host.host_block_of(key)
            assert host_block_id is not None
            level.storing.add(key)
            snapshot = self.host_bytes.host_snapshot(host_block_id)
            level.worker.submit_store(key, address, snapshot, group_of(key))

    def shared_presence(self) -> Callable[[Sequence[BlockKey]], int | None] | None:
        """``SharedWrites.presence``: the write-through shared tier's count, from any thread."""
        return self.shared.presence()

    def publish(self, keys: Sequence[BlockKey]) -> SharedProgress:
        """Disaggregated prefill (``SharedWrites.publish``): call between steps; a key in the pending
        ``SwapPlan`` counts as storing (the next step's copies write it down)."""
        return self.shared.publish(keys, set(self._plan.store_keys))

    def poll(self) -> None:
        """Apply the external tiers' finished reads and writes (and write the host blocks again to a
        shared tier that came back from an outage)."""
        for level in self.external:
            for r in level.worker.poll():
                self._apply(level, r)
            self.shared.republish(level)
            level.tier.tick()

    def wait(self, timeout: float) -> None:
        """Block until a tier's reads have all landed, else until some write finishes (or ``timeout``):
        used when nothing else can run. Waiting for every read, not the first, matters: each wake-up
        runs a scheduler step (a prefix lookup) that, on two cores, delays the reader's next file."""
        deadline = time.monotonic() + timeout
        reading = [level for level in self.external if level.promoting]
        for level in reading:
            while level.promoting and (left := deadline - time.monotonic()) > 0:
                for r in level.worker.wait(left):
                    self._apply(level, r)
        storing = [level for level in self.external if level.storing]
        if not reading and storing:
            for r in storing[0].worker.wait(timeout):
                self._apply(storing[0], r)

    def flush(self, timeout: float = 60.0) -> None:
        """Write every held host block down to the external tiers and wait (engine shutdown: a
        restart finds them)."""
        shared = [k for k in self.host.held_keys() if k not in self._private]
        for level in self.external:
            if level.active:
                self._store_down(level, shared)
        for level in self.external:
            self._settle(level, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the external tiers' workers (after the jobs already submitted; a stalled one is left
        behind: ``_settle``)."""
        for level in self.external:
            self._settle(level, timeout)
            for r in level.worker.close(timeout=0.0 if level.stalled else IO_STALL_S):
                self._apply(level, r)
            level.tier.close()

    def _settle(self, level: ExternalLevel, timeout: float) -> None:
        level.settle(timeout, IO_STALL_S, lambda r: self._apply(level, r))

    def _apply(self, level: ExternalLevel, r: IOResultLike) -> None:
        tier = level.tier
        if r.kind == "load":
            level.promoting.discard(r.key)
            self.host.complete_store([r.key], ok=r.ok)
            if r.ok:
                self._promoted[r.key] = tier.medium
                tier.complete_load([r.key], r.seconds)
            else:
                tier.invalidate(r.key, r.error or "unreadable")  # drops the pin, removes the block
        else:
            level.storing.discard(r.key)
            tier.complete_store([r.key], ok=r.ok, seconds=r.seconds)
            if r.ok and self.on_stored is not None:
                self.on_stored(tier.medium, [r.key])
            if not r.ok and r.fatal and not tier.disabled:
                tier.disable(r.error or "write failed")
