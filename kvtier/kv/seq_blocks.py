"""What the KV manager keeps per sequence: one block table per KV group, and its hash progress.

Every group's table covers the same block positions; a table entry is a block, or ``None`` (a *null
entry*) where a sliding group released a block its window no longer reaches. Null entries only ever
form a prefix of a sliding group's table, and never reach into the window of the sequence's next
query (``num_computed_tokens``)::

    position          0     1     2     3     4     5     6        (B = 4, W = 9, 26 tokens computed)
    group 0 (full)    b0    b4    b9    b3    b7    b2    b5
    group 1 (sliding) None  None  None  None  b8    b1    b6       next query at 26 sees 18..26:
                      └──── num_released[1] = 4 ──┘                blocks 4..6

A dense model has one full group: one table, no null entries (today's layout).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.kv.block_pool import BlockPool, KVBlock
from kvtier.kv.computed import ComputedBlocks, GroupHit
from kvtier.kv.groups import NULL_BLOCK_ID, KVLayout
from kvtier.kv.hashing import BlockHash, ExtraKey, group_key
from kvtier.kv.lower import SwappedOut
from kvtier.stats import Medium

Table = list[KVBlock | None]
Load = tuple[int, int, BlockHash, Medium]  # (group, position, key, the tier whose bytes are loaded)
Entry = tuple[int, int, KVBlock]  # (group, position, block) of a live table entry


def _id(block: KVBlock | None) -> int:
    return NULL_BLOCK_ID if block is None else block.block_id


def blocks_to_allocate(num_table_blocks: int, num_total_tokens: int, block_size: int) -> int:
    """Fresh blocks a table of ``num_table_blocks`` needs to cover ``num_total_tokens`` slots."""
    return max(0, -(-num_total_tokens // block_size) - num_table_blocks)


@dataclass
class SeqBlocks:
    """What the manager knows about one live sequence."""

    tables: list[Table]  # one per KV group, all of the same length
    root: BlockHash
    # block_hashes[i] is the chained hash of block i (group 0's key); grows as blocks become full.
    block_hashes: list[BlockHash]
    # Blocks [0, num_cached_blocks) have been offered to the hash map (a duplicate may have lost).
    num_cached_blocks: int
    # The most tokens the manager was told are computed: the next query's position (window release).
    num_computed_tokens: int = 0
    # Per group, the leading null entries of its table (0 for a full group).
    num_released: list[int] = field(default_factory=list)
    # The extra keys ``root`` was made from (a later call passing these same keys needs no rehash).
    extra_keys: tuple[ExtraKey, ...] = ()
    # Each group's table as int64 block ids, the runner's view (``block_ids``): built once, then extended
    # as the tables grow at their end; ``touch`` drops it when an entry changes in place.
    _ids: list[array[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.num_released:
            self.num_released = [0] * len(self.tables)

    def block_ids(self) -> list[array[int]]:
        """Each group's table as int64 block ids (``NULL_BLOCK_ID`` for a null entry), without a walk over
        the whole table each step: only entries appended since the last call are read. The arrays are
        the sequence's own: copy them to keep them (a slice is one memcpy)."""
        ids = self._ids
        if ids is None:
            ids = self._ids = [array("q", [_id(b) for b in t]) for t in self.tables]
        elif len(ids[0]) < len(self.tables[0]):
            for known, table in zip(ids, self.tables, strict=True):
                known.extend([_id(b) for b in table[len(known) :]])
        return ids

    def without_tables(self, num_blocks: int) -> SeqBlocks:
        """Its hash progress over its first ``num_blocks`` positions, with empty tables (what a swap
        keeps while the blocks are in the host tier)."""
        hashed = min(self.num_cached_blocks, num_blocks)
        empty: list[Table] = [[] for _ in self.tables]
        return SeqBlocks(empty, self.root, list(self.block_hashes), hashed, extra_keys=self.extra_keys)

    def touch(self) -> None:
        """An entry changed in place (a load placed, a copy-on-write, a release, a restore)."""
        self._ids = None

    @property
    def num_blocks(self) -> int:
        """Block positions the tables cover (null entries included)."""
        return len(self.tables[0])

    @property
    def num_held_blocks(self) -> int:
        """Blocks the tables reference, over every group (null entries not counted)."""
        return sum(len(t) - released for t, released in zip(self.tables, self.num_released, strict=True))

    def writes_in_place(self, position: int, block_size: int, sliding: bool) -> bool:
        """Whether the slot of ``position`` lies in a block the tables hold and this sequence alone
        references, in every group, with no window to slide (``sliding``: the layout has one): a dense
        model's decode token, usually. Then its allocation has nothing to do."""
        i = position // block_size
        if sliding or i >= len(self.tables[0]):
            return False
        return all((b := t[i]) is not None and b.ref_cnt == 1 for t in self.tables)

    def live(self) -> Iterator[Entry]:
        """Every non-null entry, group by group."""
        for g, table in enumerate(self.tables):
            for i in range(self.num_released[g], len(table)):
                block = table[i]
                assert block is not None, f"null entry at {i} after the released prefix of group {g}"
                yield g, i, block

    def live_from_tail(self) -> list[KVBlock]:
        """Every non-null entry, last position first (within a position, group by group): the order a
        free hands them to the pool, so a sequence's tail is evicted before its head."""
        return [
            block
            for i in range(self.num_blocks - 1, -1, -1)
            for table in self.tables
            if (block := table[i]) is not None
        ]

    def cached_keys(self, dense: bool) -> list[BlockHash]:
        """The keys of the live entries offered to the hash map, by position (``dense``: one group)."""
        if dense:
            return self.block_hashes[: self.num_cached_blocks]
        return [
            group_key(self.block_hashes[i], g)
            for i in range(self.num_cached_blocks)
            for g, table in enumerate(self.tables)
            if table[i] is not None
        ]

    def window_entries(self, firsts: Sequence[int], num_blocks: int) -> list[Entry]:
        """The entries of positions ``[firsts[g], num_blocks)``, group by group (what a swap stores);
        raises ``ValueError`` if one of them was released."""
        entries = []
        for g, table in enumerate(self.tables):
            for i in range(firsts[g], num_blocks):
                block = table[i]
                if block is None:
                    raise ValueError(f"group {g} released block {i}, still in the window of the swap")
                entries.append((g, i, block))
        return entries

    def unreachable(self, layout: KVLayout, block_size: int, query_pos: int) -> list[Entry]:
        """The live entries that no query at ``query_pos`` or later can read (sliding groups only), by
        position, then group (the order they reach the free queue: the oldest is evicted first)."""
        found: list[Entry] = []
        for g, spec in enumerate(layout.groups):
            if spec.window is None:
                continue
            end = min(spec.first_reachable_block(query_pos, block_size), self.num_blocks)
            table = self.tables[g]
            found += [
                (g, i, block) for i in range(self.num_released[g], end) if (block := table[i]) is not None
            ]
        found.sort(key=lambda entry: (entry[1], entry[0]))
        return found

    def release(self, pool: BlockPool, entries: list[Entry]) -> None:
        """Null ``entries`` and drop their references: a cached block nobody else holds stays in the
        prefix cache as an idle block (evicted, and stored down the tiers, like any)."""
        for g, i, _ in entries:
            self.tables[g][i] = None
            self.num_released[g] = max(self.num_released[g], i + 1)
        self.touch()
        pool.free_blocks((block for _, _, block in entries), cold=True)


def hit_tables(
    seq_id: str, pool: BlockPool, hits: Sequence[GroupHit], num_tokens: int, block_size: int
) -> tuple[list[Table], list[Load], list[int]]:
    """Each group's table for an adopted hit of ``num_tokens`` tokens (device hits; None for null
    entries and for loads), the loads, and each group's null prefix. Raises ``ValueError`` if a device
    hit went stale (evicted since the lookup)."""
    num_blocks = num_tokens // block_size
    if num_tokens % block_size or any(hit.num_blocks != num_blocks for hit in hits):
        raise ValueError(f"{seq_id}: ComputedBlocks covers a partial block")
    tables: list[Table] = []
    loads: list[Load] = []
    for g, hit in enumerate(hits):
        table: Table = [None] * num_blocks
        for j, (block_id, key, source) in enumerate(zip(hit.block_ids, hit.keys, hit.sources, strict=True)):
            if block_id is None:
                loads.append((g, hit.first + j, key, source))
                continue
            block = pool.blocks[block_id]
            if block.block_hash is None or block.block_hash != key:
                raise ValueError(
                    f"{seq_id}: stale ComputedBlocks: block {block_id} was evicted after the lookup"
                )
            table[hit.first + j] = block
        tables.append(table)
    return tables, loads, [hit.first for hit in hits]


def check_tables(
    seq_id: str,
    seq: SeqBlocks,
    layout: KVLayout,
    pool: BlockPool,
    block_size: int,
    refs: Counter[int],
    group_of: dict[int, int],
) -> None:
    """One sequence's share of ``KVCacheManager.check_integrity``: its tables are well formed (equal
    lengths, null entries only leading a sliding table and before its window, each block of the pool,
    in use, cached under the sequence's own key, in one group only); counts its references in
    ``refs``. Raises ``AssertionError``."""
    assert len(seq.tables) == layout.num_groups, f"{seq_id}: {len(seq.tables)} tables"
    assert len({len(table) for table in seq.tables}) == 1, f"{seq_id}: group tables of unequal length"
    assert seq.num_cached_blocks <= seq.num_blocks, f"{seq_id}: more cached blocks than blocks"
    for g, (spec, table) in enumerate(zip(layout.groups, seq.tables, strict=True)):
        released = seq.num_released[g]
        assert all(b is None for b in table[:released]), f"{seq_id}: group {g} released a live entry"
        reach = spec.first_reachable_block(seq.num_computed_tokens, block_size)
        assert released <= reach, f"{seq_id}: group {g} released block {released - 1} still in its window"
        ids = [block.block_id for block in table[released:] if block is not None]
        assert len(ids) == len(table) - released, f"{seq_id}: group {g} has a null entry in its window"
        assert len(set(ids)) == len(ids), f"{seq_id}: a block appears twice in its table"
        for i, block in enumerate(table[released:], start=released):
            assert block is not None and pool.blocks[block.block_id] is block, f"{seq_id}: foreign block"
            assert block.ref_cnt > 0, f"{seq_id}: table holds block {block.block_id} with ref_cnt 0"
            assert group_of.setdefault(block.block_id, g) == g, f"block {block.block_id} in two groups"
            # A fork child may not have hashed a block its parent cached since; if it has, they agree.
            if block.block_hash is not None and i < len(seq.block_hashes):
                assert group_key(seq.block_hashes[i], g) == block.block_hash, (
                    f"{seq_id}: block {block.block_id} is cached under a hash other than the sequence's"
                )
        refs.update(ids)
    if seq._ids is not None:  # the runner's view, extended since: what the tables hold now
        expected = [[_id(b) for b in table] for table in seq.tables]
        assert [list(ids) for ids in seq.block_ids()] == expected, f"{seq_id}: stale block ids"


def check_slots(
    seq_id: str,
    seq: SeqBlocks | None,
    num_tokens: int,
    num_computed: int,
    num_new: int,
    computed: ComputedBlocks | None,
    block_size: int,
) -> None:
    """``KVCacheManager.allocate_slots``' arguments for sequence ``seq`` (None: its first allocation)
    of ``num_tokens`` tokens: ``ValueError`` for ones no allocation can satisfy."""
    if num_computed < 0 or num_new < 0:
        raise ValueError(f"negative token counts: computed={num_computed} new={num_new}")
    if num_computed + num_new > num_tokens:
        raise ValueError(
            f"{seq_id}: {num_computed + num_new} slots requested but the sequence has {num_tokens} tokens"
        )
    if seq is None:
        adopted = computed.num_computed_tokens if computed is not None else 0
        if num_computed != adopted:
            raise ValueError(
                f"{seq_id}: first allocation with num_computed_tokens={num_computed}, but the "
                f"adopted prefix covers {adopted}"
            )
        return
    if computed is not None and computed.block_ids:
        raise ValueError(f"{seq_id}: prefix blocks can only be adopted on the first allocation")
    if num_computed > seq.num_blocks * block_size:
        raise ValueError(
            f"{seq_id}: {num_computed} computed tokens but the table covers {seq.num_blocks * block_size}"
        )


def check_seqs(
    seqs: Mapping[str, SeqBlocks], layout: KVLayout, pool: BlockPool, block_size: int, caching: bool
) -> None:
    """The sequences' share of ``KVCacheManager.check_integrity``: each one's tables (``check_tables``),
    and every pool block's ``ref_cnt`` equal to the tables' references. Raises ``AssertionError``."""
    refs: Counter[int] = Counter()
    group_of: dict[int, int] = {}
    for seq_id, seq in seqs.items():
        if caching:
            assert seq.num_cached_blocks <= len(seq.block_hashes), f"{seq_id}: cached blocks without hash"
        check_tables(seq_id, seq, layout, pool, block_size, refs, group_of)
    for block in pool.blocks:
        assert block.ref_cnt == refs[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs[block.block_id]} table references"
        )


def blocks_in_use_by_group(seqs: Iterable[SeqBlocks], num_groups: int) -> tuple[int, ...]:
    """Distinct device blocks each KV group's live tables hold (a shared block counted once)."""
    in_use: list[set[int]] = [set() for _ in range(num_groups)]
    for seq in seqs:
        for g, _, block in seq.live():
            in_use[g].add(block.block_id)
    return tuple(len(ids) for ids in in_use)


@dataclass
class Swapped:
    """A sequence preempted by swap: its hash progress, and its blocks pinned in the host tier in
    ``out.keys`` order: group by group, positions ``[firsts[g], num_blocks)`` of each."""

    seq: SeqBlocks  # with empty tables
    out: SwappedOut
    firsts: tuple[int, ...]  # per group, the first position stored (its window's first block)
    num_blocks: int  # block positions that held computed tokens

    def num_blocks_to_restore(self, num_table: int) -> int:
        """Device blocks a resume covering ``num_table`` positions takes (loads and new ones)."""
        return sum(num_table - first for first in self.firsts)

    def restore(
        self, fresh: list[KVBlock], num_table: int, plan_loads: Callable[[list[int]], list[int]]
    ) -> None:
        """Give ``seq`` its tables back from ``fresh`` blocks (group by group, positions
        ``[firsts[g], num_table)``, null before). ``plan_loads`` plans the loads of ``out.keys`` into the
        blocks to load (their ids, in that order) and returns the block each key takes (its pairing)."""
        self.seq.tables, loaded, start = [], [], 0
        for first in self.firsts:
            blocks = fresh[start : start + num_table - first]
            start += len(blocks)
            self.seq.tables.append([None] * first + blocks)
            loaded += blocks[: self.num_blocks - first]
        by_id = {block.block_id: block for block in loaded}
        seats = [(g, i) for g, first in enumerate(self.firsts) for i in range(first, self.num_blocks)]
        for (g, i), block_id in zip(seats, plan_loads(list(by_id)), strict=True):
            self.seq.tables[g][i] = by_id[block_id]
        self.seq.num_released = list(self.firsts)
        self.seq.touch()
