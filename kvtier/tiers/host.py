"""The host tier (L2): a fixed number of blocks in host memory, an LRU map of keys to host blocks.

This module is the bookkeeping only; the bytes live in one buffer owned by the transfer layer
(``kvtier/transfer/mover.py``: pinned memory on CUDA, an ordinary tensor on CPU), and host block
``h`` of this tier is block ``h`` of that buffer (host block ids are not device block ids). A host
block is in one of four states::

    free        not in any map                          handed out by prepare_store
    reserved    key in _reserved: bytes on their way    invisible to lookup, never evicted
    held        key in _held (LRU order, oldest first)  lookup hits; evicted when room is needed
    pinned      held or reserved, with pins > 0         a load in flight or a swapped-out sequence:
                                                        never evicted

Eviction pops the oldest unpinned held key, passing over (and moving to the recently used end) a key
that is retained (kvtier/kv/retention.py) while the tier protects fewer than its cap.
``on_evict(key, host_block_id)`` sees it first, while its
bytes are still intact, so the coordinator can demote the block to disk instead of dropping it.

KV events: ``listener`` hears of a key when it becomes held (``complete_store`` ok) and when it stops
being held (eviction, ``discard``); reserved keys are not announced. Each key's KV group comes with its
reservation (``prepare_store(keys, groups)``) and is what the coordinator writes into its header when
it demotes the block to disk or a remote store.

Counters: the tier counts its own evictions; the mover records the device↔host copies it runs into
``counters`` (it did the work); lookups and hits are counted by the coordinator.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvtier.kv.lower import KeyGroups
from kvtier.kv.retention import Retention, TierProtection
from kvtier.stats import Medium, TierCounters
from kvtier.tiers.base import BlockKey, KVTier, LoadSpec, StoreSpec


class HostTier(KVTier):
    medium = Medium.HOST

    def __init__(
        self,
        num_blocks: int,
        on_evict: Callable[[BlockKey, int], None] | None = None,
        retention: Retention | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.protection = TierProtection(retention, num_blocks)
        self.counters = TierCounters()
        self.on_evict = on_evict
        self._num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._held: OrderedDict[BlockKey, int] = OrderedDict()
        self._cold: set[BlockKey] = set()  # reserved cold keys: held at the eviction end once stored
        self._reserved: dict[BlockKey, int] = {}
        self._pins: Counter[BlockKey] = Counter()
        self._key_groups: dict[BlockKey, int] = {}

    # ------------------------------------------------------------------------ occupancy
    @property
    def capacity_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    def num_retained_blocks(self) -> int:
        return self.protection.count(self._held)

    def contains(self, key: BlockKey, group: int = 0) -> bool:
        return key in self._held

    def host_block_of(self, key: BlockKey) -> int | None:
        """The host block id of a held or reserved key."""
        host_block_id = self._held.get(key)
        return self._reserved.get(key) if host_block_id is None else host_block_id

    def held_keys(self) -> list[BlockKey]:
        """Held keys, least recently used first."""
        return list(self._held)

    # ------------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadSpec:
        host_block_ids = self.pinned_blocks(keys)
        self.pin(keys)
        return LoadSpec(tuple(keys), tuple(host_block_ids))

    def pinned_blocks(self, keys: Sequence[BlockKey]) -> list[int]:
        """The host blocks of held ``keys`` (a ``KeyError`` for one it does not hold): ``prepare_load``
        without its pin, for a caller whose own pins (``pin``) carry the load to ``complete_load``."""
        held = self._held
        try:
            return [held[key] for key in keys]
        except KeyError as exc:
            raise KeyError(f"host tier: load of a key it does not hold ({exc.args[0].hex()[:12]})") from None

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        self.unpin(keys)
        for key in keys:
            if key in self._held:
                self._held.move_to_end(key)

    # ------------------------------------------------------------------------ stores
    def prepare_store(
        self, keys: Sequence[BlockKey], groups: KeyGroups = (), cold: bool = False
    ) -> StoreSpec:
        """Reserve host blocks for ``keys`` (evicting the least recently used unpinned ones); ``cold``
        keys (a sliding group's blocks out of their window) take free blocks only, and are held first in
        line for eviction, so they never push out a block a returning prompt needs."""
        held, reserved, free = self._held, self._reserved, self._free
        walk = None if cold else self.protection.evictable(held, self._pins)
        accepted: list[BlockKey] = []
        evicted: dict[BlockKey, None] = {}  # in order
        room = len(free)
        # in order, without duplicates, as if stored one by one: a held key that an earlier key of the
        # batch evicted is stored again
        for key in dict.fromkeys(keys):
            if key in reserved or (key in held and key not in evicted):
                continue
            if room:
                room -= 1
            else:
                victim = None if walk is None else next(walk, None)
                if victim is None:
                    break  # no free room for a cold block, or everything is pinned or reserved
                evicted[victim] = None
            accepted.append(key)
        if walk is not None:
            walk.close()
        self._evict(list(evicted))
        host_block_ids = [free.pop() for _ in accepted]
        reserved.update(zip(accepted, host_block_ids, strict=True))
        self._note_groups(keys, groups, accepted)
        if cold:
            self._cold.update(accepted)
        return StoreSpec(tuple(accepted), tuple(host_block_ids), tuple(evicted))

    def reassign(self, keys: Sequence[BlockKey], host_block_ids: Sequence[int]) -> None:
        """Reserved ``keys`` take ``host_block_ids`` (the same blocks, in another order) before their
        stores run: the coordinator pairs them with the device blocks' order."""
        for key, host_block_id in zip(keys, host_block_ids, strict=True):
            self._reserved[key] = host_block_id

    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True) -> None:
        for key in keys:
            host_block_id = self._reserved.pop(key)
            if ok:
                self._held[key] = host_block_id
                if key in self._cold:
                    self._held.move_to_end(key, last=False)  # the first evicted
            else:
                self._pins.pop(key, None)
                self._free.append(host_block_id)
        self._cold.difference_update(keys)
        if ok:
            self._announce_stored(keys)
        else:
            self._forget_groups(keys)

    def _evict(self, keys: list[BlockKey]) -> None:
        """Free the blocks of held ``keys`` (``protection.evictable``'s)."""
        for key in keys:
            host_block_id = self._held.pop(key)
            if self.on_evict is not None:
                self.on_evict(key, host_block_id)
            self._pins.pop(key, None)
            self.protection.forget(key)
            self._free.append(host_block_id)
        self.counters.blocks_evicted += len(keys)
        self._announce_removed(keys)

    # ------------------------------------------------------------------------ pins
    def pin(self, keys: Iterable[BlockKey]) -> None:
        """Keep held or reserved keys from eviction (a load in flight, a swapped-out sequence)."""
        for key in keys:
            if key not in self._held and key not in self._reserved:
                raise KeyError(f"host tier: pin of a key it does not hold ({key.hex()[:12]})")
            self._pins[key] += 1

    def cool(self, keys: Iterable[BlockKey]) -> None:
        """Move held ``keys`` to the eviction end: blocks no running sequence's window reaches any more."""
        for key in keys:
            if key in self._held:
                self._held.move_to_end(key, last=False)

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            if self._pins[key] <= 0:
                raise ValueError(f"host tier: unpin of a key that is not pinned ({key.hex()[:12]})")
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]

    def discard(self, keys: Iterable[BlockKey]) -> None:
        """Drop unpinned held keys now (a swapped-out sequence's private blocks after its resume)."""
        dropped = [key for key in dict.fromkeys(keys) if key in self._held and not self._pins[key]]
        for key in dropped:
            self._free.append(self._held.pop(key))
            self.protection.forget(key)
        self._announce_removed(dropped)

    def check_integrity(self) -> None:
        used = list(self._held.values()) + list(self._reserved.values())
        assert len(set(used)) == len(used), "host tier: a host block is used twice"
        assert not set(used) & set(self._free), "host tier: a used host block is also free"
        assert len(used) + len(self._free) == self._num_blocks, "host tier: blocks do not add up"
        for key in self._pins:
            assert key in self._held or key in self._reserved, "host tier: a pin on a key it does not hold"
        for key in self._key_groups:
            assert key in self._held or key in self._reserved, "host tier: a group of a key it does not hold"
