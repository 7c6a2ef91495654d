"""The host tier (L2): a fixed number of block slots in host memory, an LRU map of keys to slots.

This module is the bookkeeping only; the bytes live in one buffer owned by the transfer layer
(``kvtier/transfer/mover.py``: pinned memory on CUDA, an ordinary tensor on CPU), and slot ``s`` of
this tier is block ``s`` of that buffer. A slot is in one of four states::

    free        not in any map                          handed out by prepare_store
    reserved    key in _reserved: bytes on their way    invisible to lookup, never evicted
    held        key in _held (LRU order, oldest first)  lookup hits; evicted when room is needed
    pinned      held or reserved, with pins > 0         a load in flight or a swapped-out sequence:
                                                        never evicted

Eviction pops the oldest unpinned held key. ``on_evict(key, slot)`` sees it first, while the slot's
bytes are still intact, so the coordinator can demote the block to disk instead of dropping it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvtier.tiers.base import BlockKey, KVTier, LoadSpec, Medium, StoreSpec, TierStats


class HostTier(KVTier):
    medium = Medium.HOST

    def __init__(self, num_slots: int, on_evict: Callable[[BlockKey, int], None] | None = None) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.stats = TierStats()
        self.on_evict = on_evict
        self._num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._held: OrderedDict[BlockKey, int] = OrderedDict()
        self._reserved: dict[BlockKey, int] = {}
        self._pins: Counter[BlockKey] = Counter()

    # ------------------------------------------------------------------------ occupancy
    @property
    def capacity_blocks(self) -> int:
        return self._num_slots

    @property
    def num_used_blocks(self) -> int:
        return self._num_slots - len(self._free)

    def contains(self, key: BlockKey) -> bool:
        return key in self._held

    def slot_of(self, key: BlockKey) -> int | None:
        """The slot of a held or reserved key."""
        slot = self._held.get(key)
        return self._reserved.get(key) if slot is None else slot

    def held_keys(self) -> list[BlockKey]:
        """Held keys, least recently used first."""
        return list(self._held)

    # ------------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadSpec:
        slots = []
        for key in keys:
            if key not in self._held:
                raise KeyError(f"host tier: load of a key it does not hold ({key.hex()[:12]})")
            slots.append(self._held[key])
        self.pin(keys)
        return LoadSpec(tuple(keys), tuple(slots))

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        self.unpin(keys)
        for key in keys:
            if key in self._held:
                self._held.move_to_end(key)

    # ------------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[BlockKey]) -> StoreSpec:
        accepted: list[BlockKey] = []
        slots: list[int] = []
        evicted: list[BlockKey] = []
        for key in dict.fromkeys(keys):  # in order, without duplicates
            if key in self._held or key in self._reserved:
                continue
            if not self._free and not self._evict_one(evicted):
                break  # everything is pinned or reserved: the rest does not fit
            slot = self._free.pop()
            self._reserved[key] = slot
            accepted.append(key)
            slots.append(slot)
        return StoreSpec(tuple(accepted), tuple(slots), tuple(evicted))

    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True) -> None:
        for key in keys:
            slot = self._reserved.pop(key)
            if ok:
                self._held[key] = slot
            else:
                self._pins.pop(key, None)
                self._free.append(slot)

    def _evict_one(self, evicted: list[BlockKey]) -> bool:
        for key in self._held:
            if not self._pins[key]:
                break
        else:
            return False
        slot = self._held[key]
        if self.on_evict is not None:
            self.on_evict(key, slot)
        del self._held[key]
        self._pins.pop(key, None)
        self._free.append(slot)
        evicted.append(key)
        self.stats.blocks_evicted += 1
        return True

    # ------------------------------------------------------------------------ pins
    def pin(self, keys: Iterable[BlockKey]) -> None:
        """Keep held or reserved keys from eviction (a load in flight, a swapped-out sequence)."""
        for key in keys:
            if key not in self._held and key not in self._reserved:
                raise KeyError(f"host tier: pin of a key it does not hold ({key.hex()[:12]})")
            self._pins[key] += 1

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            if self._pins[key] <= 0:
                raise ValueError(f"host tier: unpin of a key that is not pinned ({key.hex()[:12]})")
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]

    def discard(self, keys: Iterable[BlockKey]) -> None:
        """Drop unpinned held keys now (a swapped-out sequence's private blocks after its resume)."""
        for key in keys:
            if key in self._held and not self._pins[key]:
                self._free.append(self._held.pop(key))

    def check_integrity(self) -> None:
        used = list(self._held.values()) + list(self._reserved.values())
        assert len(set(used)) == len(used), "host tier: a slot is used twice"
        assert not set(used) & set(self._free), "host tier: a used slot is also free"
        assert len(used) + len(self._free) == self._num_slots, "host tier: slots do not add up"
        for key in self._pins:
            assert key in self._held or key in self._reserved, "host tier: a pin on a key it does not hold"
