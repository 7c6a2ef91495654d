"""``ComputedBlocks``: what a prefix lookup found, handed from ``get_computed_blocks`` to the first
``allocate_slots`` of a sequence (``kvtier/kv/manager.py``; the hybrid search is ``group_lookup.py``),
and what an adopted lookup tells the observers (``AdoptedPrefix``, ``AccessObserver``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.kv.groups import KVLayout
from kvtier.kv.hashing import BlockHash, extend_block_hashes
from kvtier.kv.lower import NO_LOWER_HIT, LowerHit
from kvtier.stats import Medium


@dataclass(frozen=True)
class GroupHit:
    """One KV group's part of a prefix hit of ``n`` blocks: its table entries for block positions
    ``[first, n)``. Positions before ``first`` become null entries (a sliding window no longer reaches
    them; ``first`` is 0 for a full-attention group)::

        position     0    1    2  | 3    4    5    6          (n = 7, first = 3)
        table        -    -    -  | b8   b2   load load
        sources                   | DEV  DEV  HOST DISK       (DISK: read up into host for this hit)
    """

    first: int
    # One per position in [first, n): the device block that hit, or None where a fresh device block is
    # loaded from the lower tiers (under ``keys[j]``, bytes from ``sources[j]``).
    block_ids: tuple[int | None, ...]
    keys: tuple[BlockHash, ...]  # the group's keys of positions [first, n)
    sources: tuple[Medium, ...]  # Medium.DEVICE where block_ids[j] is set, else the loaded tier

    @property
    def num_blocks(self) -> int:
        """The hit's length in block positions (null entries included)."""
        return self.first + len(self.block_ids)


NO_GROUP_HIT = GroupHit(0, (), (), ())


@dataclass(frozen=True)
class ComputedBlocks:
    """Result of a prefix lookup: cached blocks covering a prompt's leading tokens. Owned by no one
    until ``allocate_slots`` adopts it, so use it in the same scheduling decision that made it.

    The device hits come first, then the blocks a lower tier holds (``lower.host_keys``: loaded into
    fresh device blocks by this step's swap plan)::

        prompt blocks   | b0  b1  b2 | b3  b4 | b5  b6  (b7 ...)
                          device hits  host     on disk, being   computed
                          block_ids    hits     read (pending)

    With several KV groups (a hybrid layout) ``groups`` holds each group's entries, and the flat fields
    describe group 0 (the first full-attention group, which covers every hit token): its device hits,
    its loads in ``lower`` (whose ``num_pending_blocks`` counts the reads pending for every group), and
    ``block_hashes`` the chain of the hit. A one-group lookup leaves ``groups`` empty.
    """

    block_ids: tuple[int, ...]
    num_computed_tokens: int  # (len(block_ids) + len(lower.host_keys)) * block_size
    # The hashes the lookup matched, so ``allocate_slots`` can tell if a block was evicted since.
    block_hashes: tuple[BlockHash, ...] = field(default=(), repr=False)
    lower: LowerHit = NO_LOWER_HIT
    # What the lookup asked, counted in the statistics only when the hit is adopted (a request held
    # back, e.g. while its disk blocks are read, is looked up again at every step).
    num_lookup_tokens: int = 0
    num_lookup_blocks: int = 0  # full blocks asked of the device pool
    groups: tuple[GroupHit, ...] = ()  # per KV group, for a layout of more than one group

    def adopted(
        self,
        token_ids: Sequence[int],
        block_size: int,
        root: BlockHash,
        tables: Sequence[Sequence[int | None]],
    ) -> AdoptedPrefix:
        """What the observers are told when this hit is adopted into ``tables`` (each group's block ids,
        None for a null entry): every full prompt block looked up (hits first), where the hits came
        from, where they are now; with several groups, each group's hit blocks too."""
        keys = list(self.block_hashes)
        extend_block_hashes(keys, token_ids, block_size, root, self.num_lookup_blocks * block_size)
        served = [Medium.DEVICE] * len(self.block_ids)
        served += [self.lower.source_of(i) for i in range(len(self.lower.host_keys))]
        table = [i for i in tables[0] if i is not None]
        groups = tuple(
            AdoptedGroup(g, hit.first, hit.keys, hit.sources, tuple(tables[g][hit.first : hit.num_blocks]))
            for g, hit in enumerate(self.groups)
        )
        return AdoptedPrefix(tuple(keys), tuple(served), tuple(table[: len(served)]), groups)

    def tokens_by_tier(self, block_size: int) -> dict[Medium, int]:
        """Prompt tokens this hit serves, by the tier they come from (every medium, zeros included)."""
        blocks = {Medium.DEVICE: len(self.block_ids), **self.lower.blocks_by_tier()}
        return {medium: blocks.get(medium, 0) * block_size for medium in Medium}


NO_COMPUTED_BLOCKS = ComputedBlocks(block_ids=(), num_computed_tokens=0)


def group_hits(computed: ComputedBlocks, layout: KVLayout) -> tuple[GroupHit, ...]:
    """``computed`` as one :class:`GroupHit` per group of ``layout`` (a one-group lookup leaves its
    single group implicit in the flat fields: device hits, then the lower tiers' keys)."""
    num_groups = layout.num_groups
    if computed.groups:
        if len(computed.groups) != num_groups:
            raise ValueError(f"ComputedBlocks of {len(computed.groups)} groups for a layout of {num_groups}")
        return computed.groups
    if not layout.is_dense:
        if computed.num_computed_tokens:
            raise ValueError(f"a one-group ComputedBlocks adopted by a layout of {num_groups} groups")
        return (NO_GROUP_HIT,) * num_groups
    lower = computed.lower
    num_loads = len(lower.host_keys)
    sources = (Medium.DEVICE,) * len(computed.block_ids) + tuple(lower.source_of(j) for j in range(num_loads))
    return (GroupHit(0, computed.block_ids + (None,) * num_loads, computed.block_hashes, sources),)


@dataclass(frozen=True)
class AdoptedGroup:
    """One KV group's hit blocks in an adopted lookup: positions ``[first, first + len(keys))``."""

    group: int
    first: int  # the group's first hit position (a sliding group's window start; 0 for a full group)
    keys: tuple[BlockHash, ...]  # the group's keys of those positions
    served_by: tuple[Medium, ...]  # the tier each came from
    block_ids: tuple[int | None, ...]  # the device blocks holding them now (loads land this step)


@dataclass(frozen=True)
class AdoptedPrefix:
    """What one adopted lookup touched, for an :class:`AccessObserver` (``kvtier/insight``). With
    several KV groups the flat fields describe group 0 (the first full-attention group) and ``groups``
    every group's hit blocks (the canary samples them all); a one-group lookup leaves it empty."""

    keys: tuple[BlockHash, ...]  # every full prompt block looked up, in order; the hits lead
    served_by: tuple[Medium, ...]  # the tier of each hit block (device, host, disk, ...)
    block_ids: tuple[int, ...]  # the device blocks holding the hits now (loads land this step)
    groups: tuple[AdoptedGroup, ...] = ()


class AccessObserver(Protocol):
    """Told of every adopted prefix lookup, of every block newly entered into the device cache, and of
    a sequence's cached blocks when it frees them (the miss-ratio trackers and the canary); called on
    the scheduler's thread, must be cheap. With several KV groups ``on_adopt`` sees group 0's view and
    ``on_cached`` / ``on_freed`` every group's keys (they all take pool blocks)."""

    def on_adopt(self, seq_id: str, token_ids: Sequence[int], adopted: AdoptedPrefix) -> None: ...
    def on_cached(self, keys: Sequence[BlockHash]) -> None: ...
    def on_freed(self, keys: Sequence[BlockHash]) -> None: ...
