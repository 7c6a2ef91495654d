"""``KVCacheManager``: per-sequence block tables over one :class:`BlockPool`, one table per KV group.

This is the only KV API the scheduler calls. A sequence's *block table* maps its token slots to
blocks: slot ``s`` lives in ``table[s // block_size]`` at offset ``s % block_size``::

    token slots   0 ........ 15 | 16 ....... 31 | 32 ....... 47 | 48 .. 52
    block table   [   b4        |    b9         |    b1         |  b6 (partial)  ]
                   cached, shared   cached         computed        being written
                   (prefix hit)                    (not yet        this step
                                                    cached)

Life of a sequence, as the scheduler drives it::

    computed = get_computed_blocks(tokens, extra_keys)        # pure lookup of the cached prefix
    allocate_slots(seq, tokens, computed.num_computed_tokens,  # adopt the hit, add blocks for the
                   num_new, computed, extra_keys)              # new slots (False: no room, no change)
    ... worker runs the step: take_block_copies(), then KV written into the new slots ...
    cache_blocks(seq, tokens, num_computed)                    # newly full blocks enter the hash map
    allocate_slots(seq, tokens, num_computed, 1)               # decode steps, one slot each
    fork(seq, child)                                           # n > 1 sampling: share the table
    free(seq)                                                  # finished, aborted or preempted

Preemption by recomputation is ``free`` now and a fresh lookup later: mostly hits if nothing evicted
the full blocks. ``retain(seq, spans)`` keeps a computed prompt's blocks cached longer (retention.py).

Writers never share a block: before slots are written, ``allocate_slots`` gives the writing
sequence a private copy of any block another sequence also references (copy-on-write, after a
fork) and records ``(src_block_id, dst_block_id)``; the worker must apply those copies (from
``take_block_copies``) before the step's forward pass writes KV.

**KV groups** (``groups.py``): a hybrid model's layers form several groups, each with its own table
per sequence over the one shared pool and its own keys (``group_key(h_i, g)``; group 0 keeps ``h_i``).
A sliding group releases the blocks its window no longer reaches (null entries: ``None``, and
``NULL_BLOCK_ID`` in ``block_ids`` / ``block_tables``, the runner's view; see ``seq_blocks.py``); being
full and cached they stay in the prefix cache as idle blocks, evicted and stored down the tiers like
any other. A hit is exact across groups (``group_lookup.py``). One full group (every dense model, and
a manager built without a layout) behaves exactly as before: same block ids, hashes and calls.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.kv.block_pool import BlockPool, BlockState, KVBlock
from kvtier.kv.computed import NO_COMPUTED_BLOCKS, AccessObserver, ComputedBlocks, group_hits
from kvtier.kv.group_lookup import find_group_hit
from kvtier.kv.groups import DENSE_LAYOUT, KVLayout
from kvtier.kv.hashing import BlockHash, ChainMemo, ExtraKey, group_key, root_hash
from kvtier.kv.lower import NO_LOWER_HIT, BlockListener, LowerTiers
from kvtier.kv.plan import SwapPlan
from kvtier.kv.prefix_lookup import device_prefix, holds_last_block
from kvtier.kv.retention import Retention, RetentionSpan, retain_spans
from kvtier.kv.seq_blocks import (
    Load,
    SeqBlocks,
    Swapped,
    blocks_in_use_by_group,
    blocks_to_allocate,
    check_seqs,
    check_slots,
    hit_tables,
)
from kvtier.stats import Medium, TierCounters, TierSnapshot


@dataclass
class KVCacheStats:
    """Prompt tokens since the manager was created, counted when a lookup's hit is adopted (the
    device pool's own block counters are ``KVCacheManager.device_counters``)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of those, tokens served by any tier


class KVCacheManager:
    """Block tables for live sequences (one per KV group of ``layout``; None: one full-attention group),
    prefix reuse, copy-on-write after fork."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        on_evict: Callable[[KVBlock], None] | None = None,
        tiers: LowerTiers | None = None,
        layout: KVLayout | None = None,
        retention: Retention | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.layout = layout if layout is not None else DENSE_LAYOUT
        self.stats = KVCacheStats()
        self.device_counters = TierCounters()  # lookups, hits and evictions of the device pool
        self._on_evict = on_evict
        self.tiers = tiers
        # KV events: told when a block enters the device prefix cache and when it is evicted from it.
        self.listener: BlockListener | None = None
        self.observer: AccessObserver | None = None  # block-key accesses (kvtier/insight)
        self.device_quarantined = False  # the canary caught a bad device hit: no prefix reuse at all
        self.pool = BlockPool(num_blocks, enable_caching, on_evict=self._evicted, retention=retention)
        self._chains = ChainMemo(block_size)  # a prompt's block hashes, hashed once
        self._seqs: dict[str, SeqBlocks] = {}
        self._swapped: dict[str, Swapped] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # Device blocks whose KV was loaded from a lower tier: block_id -> (the key it was loaded under,
        # that tier). Absent: computed on the device. Only read by ``block_map``; dropped on eviction.
        self._origins: dict[int, tuple[BlockHash, Medium]] = {}

    def _evicted(self, blocks: list[KVBlock]) -> None:
        """The pool is about to reuse these cached blocks (eviction order): their KV goes below
        (write-back, the tiers told of them at once), they are counted and announced."""
        for block in blocks:
            self._origins.pop(block.block_id, None)
            if self._on_evict is not None:
                self._on_evict(block)
        if self.tiers is not None:
            self.tiers.on_device_evict(blocks)
        self.device_counters.blocks_evicted += len(blocks)
        if self.listener is not None:
            for group, run in itertools.groupby(blocks, key=lambda block: block.group):
                keys = [b.block_hash for b in run if b.block_hash is not None]
                self.listener.blocks_removed(Medium.DEVICE, keys, group)

    def _cache_block(self, block: KVBlock, key: BlockHash, token_ids: Sequence[int], group: int) -> None:
        """Enter ``block`` into the device prefix cache under ``key`` of ``group`` (announced when new)."""
        if self.pool.cache_block(block, key, token_ids, group) and self.listener is not None:
            self.listener.blocks_stored(Medium.DEVICE, [key], group)

    # ---------------------------------------------------------------- lookup

    def get_computed_blocks(
        self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...]
    ) -> ComputedBlocks:
        """The longest cached prefix of full blocks of ``token_ids``, at most ``(len - 1) // block_size``
        (the last token is computed: it makes the logits), up to the first miss; then the lower tiers
        are asked for the following blocks (``ComputedBlocks.lower``: may start disk reads). Takes no
        reference, counts nothing (``allocate_slots`` counts what it adopts); exact across KV groups."""
        if not self.enable_caching or self.device_quarantined:
            return NO_COMPUTED_BLOCKS
        if not self.layout.is_dense:
            return find_group_hit(self.pool, self.layout, self.block_size, token_ids, extra_keys, self.tiers)
        bs = self.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        block_ids, block_hashes = self._device_prefix(token_ids, extra_keys)
        lower = NO_LOWER_HIT
        if self.tiers is not None and len(block_ids) < max_blocks:
            rest = list(block_hashes)
            self._chains.extend(rest, token_ids, root_hash(extra_keys), max_blocks * bs)
            lower = self.tiers.lookup(rest[len(block_ids) :])
            block_hashes.extend(lower.host_keys)
        num_computed_tokens = (len(block_ids) + len(lower.host_keys)) * bs
        return ComputedBlocks(
            tuple(block_ids), num_computed_tokens, tuple(block_hashes), lower, len(token_ids), max_blocks
        )

    def num_device_prefix_blocks(self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...]) -> int:
        """Leading blocks of ``token_ids`` the device pool alone could serve now (a pure lookup, for
        the scheduler's estimates; a hit of this many blocks in every group)."""
        return self.num_prefix_blocks(token_ids, extra_keys, host=False)[0]

    def num_prefix_blocks(
        self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...], host: bool = True
    ) -> tuple[int, int]:
        """``num_device_prefix_blocks``, and the leading blocks the device pool then the host tier
        hold (``host``; a pure lookup: starts no read, counts nothing; a hybrid model's: the device's)."""
        if not self.layout.is_dense:
            hit = find_group_hit(self.pool, self.layout, self.block_size, token_ids, extra_keys, None)
            return (hit.num_computed_tokens // self.block_size,) * 2
        block_ids, hashes = self._device_prefix(token_ids, extra_keys)
        n, bs = len(block_ids), self.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        if not host or self.tiers is None or n == max_blocks:
            return n, n
        self._chains.extend(hashes, token_ids, root_hash(extra_keys), max_blocks * bs)
        return n, n + self.tiers.num_host_hits(hashes[n:])

    def holds_last_block(
        self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...], hit_hashes: Sequence[BlockHash]
    ) -> bool:
        """``prefix_lookup.holds_last_block`` (a hybrid layout: a whole pure lookup, every group's)."""
        if not self.layout.is_dense:
            n = len(token_ids) // self.block_size
            return n > 0 and self.num_prefix_blocks([*token_ids, 0], extra_keys)[1] >= n
        root = root_hash(extra_keys)
        return holds_last_block(self.pool, self._chains, self.tiers, token_ids, root, hit_hashes)

    def _device_prefix(
        self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...]
    ) -> tuple[list[int], list[BlockHash]]:
        return device_prefix(self.pool, self._chains, token_ids, root_hash(extra_keys))

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` computed tokens holds over every KV group (one group:
        ``ceil(num_tokens / block_size)``); the unit of the scheduler's KV estimates."""
        return self.layout.num_blocks_held(num_tokens, self.block_size)

    # ---------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
        extra_keys: tuple[ExtraKey, ...] = (),
    ) -> bool:
        """Make ``seq_id``'s tables cover slots ``[0, num_computed_tokens + num_new_tokens)``.

        On the sequence's first call the ``computed`` blocks (if any) become its table prefix and
        ``num_computed_tokens`` must equal ``computed.num_computed_tokens``; ``extra_keys`` fixes
        the root of its hash chain. Returns False, changing nothing, if the pool cannot supply the
        blocks needed: new blocks, copy-on-write copies, and idle hit blocks taken off the queue
        (a sliding group's blocks out of its window, released first, count as supply).
        """
        seq = self._seqs.get(seq_id)
        check_slots(
            seq_id, seq, len(token_ids), num_computed_tokens, num_new_tokens, computed, self.block_size
        )
        if seq is None:
            return self._adopt(seq_id, token_ids, computed or NO_COMPUTED_BLOCKS, num_new_tokens, extra_keys)
        return self._grow(seq, num_computed_tokens, num_new_tokens)

    def _adopt(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        computed: ComputedBlocks,
        num_new_tokens: int,
        extra_keys: tuple[ExtraKey, ...],
    ) -> bool:
        """A new sequence's first allocation: the prefix hit becomes its tables (device hits shared,
        lower-tier hits loaded into fresh blocks), then fresh blocks for its new slots in every group."""
        if seq_id in self._swapped:
            raise ValueError(f"{seq_id} is swapped out: resume it with swap_in")
        hits = group_hits(computed, self.layout)
        tables, loads, firsts = hit_tables(
            seq_id, self.pool, hits, computed.num_computed_tokens, self.block_size
        )
        if loads and (self.tiers is None or not self.tiers.can_load([key for _, _, key, _ in loads])):
            raise ValueError(f"{seq_id}: stale ComputedBlocks: a host block was evicted after the lookup")
        hit_blocks = [block for table in tables for block in table if block is not None]
        num_idle_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)  # taken off the free queue
        num_fresh = blocks_to_allocate(
            len(tables[0]), computed.num_computed_tokens + num_new_tokens, self.block_size
        )
        num_groups = len(tables)
        if len(loads) + num_fresh * num_groups + num_idle_hits > self.pool.num_free_blocks:
            return False
        # Feasible: from here on nothing fails. Touch hits first so new blocks cannot evict them, and
        # hold host hits so write-back stores (evictions below) cannot push them out of the host tier.
        self._count_lookup(computed)
        self.pool.touch(hit_blocks)
        if loads:
            assert self.tiers is not None
            self.tiers.hold([key for _, _, key, _ in loads])
        seq = SeqBlocks(
            tables=tables,
            root=root_hash(extra_keys),
            block_hashes=list(computed.block_hashes),
            num_cached_blocks=len(tables[0]),
            num_computed_tokens=computed.num_computed_tokens,
            num_released=firsts,
            extra_keys=extra_keys,
        )
        self._seqs[seq_id] = seq
        fresh = self.pool.get_new_blocks(len(loads) + num_fresh * num_groups)
        if loads:
            self._load_into(seq, token_ids, loads, fresh[: len(loads)])
        rest = fresh[len(loads) :]
        for g, table in enumerate(tables):
            table.extend(rest[g * num_fresh : (g + 1) * num_fresh])
        if self.observer is not None and self.layout.groups[0].window is None:  # group 0's view
            ids = [[None if b is None else b.block_id for b in table] for table in tables]
            adopted = computed.adopted(token_ids, self.block_size, seq.root, ids)
            self.observer.on_adopt(seq_id, token_ids, adopted)
        return True

    def _load_into(
        self,
        seq: SeqBlocks,
        token_ids: Sequence[int],
        loads: list[Load],
        blocks: list[KVBlock],
    ) -> None:
        """Plan loads of the lower-tier hits ``(group, position, key, tier)`` into fresh ``blocks`` put
        in the tables; they are cached under their keys at once (the step's plan fills them before any
        forward reads them)."""
        assert self.tiers is not None
        bs = self.block_size
        by_id = {block.block_id: block for block in blocks}
        ids = self.tiers.load([key for _, _, key, _ in loads], list(by_id))  # paired as the host blocks
        self.tiers.start_loads()  # the copies cross the link while the bookkeeping below runs
        for (g, i, key, source), block_id in zip(loads, ids, strict=True):
            block = seq.tables[g][i] = by_id[block_id]
            self._cache_block(block, key, token_ids[i * bs : (i + 1) * bs], g)
            self._origins[block.block_id] = (key, source)
        seq.touch()

    def _grow(self, seq: SeqBlocks, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """A live sequence's next slots: release what its windows no longer reach, private copies of
        shared blocks the slots are written into (after a fork), then fresh blocks past the end."""
        bs = self.block_size
        if num_new_tokens == 1 and seq.writes_in_place(num_computed_tokens, bs, self.layout.has_sliding):
            seq.num_computed_tokens = max(seq.num_computed_tokens, num_computed_tokens)
            return True  # what the general case below comes to for it, in fewer steps
        num_total = num_computed_tokens + num_new_tokens
        num_table = len(seq.tables[0])
        shared: list[tuple[int, int]] = []  # (group, position) written this step, referenced by others
        if num_new_tokens > 0:
            positions = range(num_computed_tokens // bs, min((num_total - 1) // bs, num_table - 1) + 1)
            for g, table in enumerate(seq.tables):
                shared += [(g, i) for i in positions if (b := table[i]) is not None and b.ref_cnt > 1]
        num_fresh = max(0, -(-num_total // bs) - num_table)
        num_needed = len(shared) + num_fresh * len(seq.tables)
        unreachable = seq.unreachable(self.layout, bs, num_computed_tokens) if self.layout.has_sliding else []
        num_released = sum(1 for _, _, block in unreachable if block.ref_cnt == 1)
        if num_needed > self.pool.num_free_blocks + num_released:
            return False
        if num_computed_tokens > seq.num_computed_tokens:
            seq.num_computed_tokens = num_computed_tokens
        if unreachable:
            seq.release(self.pool, unreachable)
        if not num_needed:
            return True
        fresh = self.pool.get_new_blocks(num_needed)
        for (g, i), dst in zip(shared, fresh, strict=False):
            src = seq.tables[g][i]
            assert src is not None
            self._pending_copies.append((src.block_id, dst.block_id))
            seq.tables[g][i] = dst
            seq.touch()
            self.pool.free_blocks([src])  # ref_cnt was > 1: stays in use by the other sequence(s)
        rest = fresh[len(shared) :]
        for g, table in enumerate(seq.tables):
            table.extend(rest[g * num_fresh : (g + 1) * num_fresh])
        return True

    def _count_lookup(self, computed: ComputedBlocks) -> None:
        self.stats.prefix_cache_queries += computed.num_lookup_tokens
        self.stats.prefix_cache_hits += computed.num_computed_tokens
        self.device_counters.lookups += computed.num_lookup_blocks
        self.device_counters.hit_blocks += len(computed.block_ids)
        if self.tiers is not None and computed.num_lookup_blocks > len(computed.block_ids):
            self.tiers.count_lookup(computed.lower, computed.num_lookup_blocks - len(computed.block_ids))

    def cache_blocks(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        extra_keys: tuple[ExtraKey, ...] = (),
    ) -> None:
        """Register every block of ``seq_id`` that is now full and computed in the hash map (each group's
        under its group key), then release the sliding groups' blocks out of the next query's reach.

        Called after a step computed KV for ``token_ids[:num_computed_tokens]``. The chained hashes
        are kept per sequence and extended, never recomputed from block 0. The chain's root was
        fixed by the first ``allocate_slots``; non-empty ``extra_keys`` are checked against it.
        """
        if not self.enable_caching:
            if self.layout.has_sliding:
                self._advance(self._seq(seq_id), num_computed_tokens)
            return
        seq = self._seq(seq_id)
        if num_computed_tokens > len(token_ids):
            raise ValueError(
                f"{seq_id}: {num_computed_tokens} computed tokens but only {len(token_ids)} tokens"
            )
        if extra_keys and extra_keys != seq.extra_keys and root_hash(extra_keys) != seq.root:
            raise ValueError(f"{seq_id}: extra_keys differ from the ones of its first allocation")
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, seq.num_blocks)
        if num_full > seq.num_cached_blocks:
            if len(seq.block_hashes) < num_full:
                self._chains.extend(seq.block_hashes, token_ids, seq.root, num_full * bs)
            keys = self._cache_new_blocks(seq, token_ids, num_full)
            if self.observer is not None:
                self.observer.on_cached(keys)
            seq.num_cached_blocks = num_full
        self._advance(seq, num_computed_tokens)

    def _cache_new_blocks(self, seq: SeqBlocks, token_ids: Sequence[int], num_full: int) -> list[BlockHash]:
        """Cache positions ``[num_cached_blocks, num_full)`` of every group; returns their keys."""
        bs = self.block_size
        keys: list[BlockHash] = []
        for i in range(seq.num_cached_blocks, num_full):
            for g, table in enumerate(seq.tables):
                block = table[i]
                if block is None:
                    continue  # released before it was offered (caching skipped a step)
                key = group_key(seq.block_hashes[i], g)
                self._cache_block(block, key, token_ids[i * bs : (i + 1) * bs], g)
                if self.tiers is not None:
                    self.tiers.on_block_full(block.block_id, key, g)
                keys.append(key)
        return keys

    def retain(self, seq_id: str, spans: Sequence[RetentionSpan]) -> int:
        """Retain the full cached blocks before each span's end for its TTL; the tokens retained."""
        retention, seq = self.pool.retention, self._seq(seq_id)
        if retention is None:
            return 0
        return retain_spans(
            retention, seq.block_hashes, seq.num_cached_blocks, self.layout, self.block_size, spans
        )

    def _advance(self, seq: SeqBlocks, num_computed_tokens: int) -> None:
        """The tokens before ``num_computed_tokens`` are computed: release what no later query reads."""
        if num_computed_tokens > seq.num_computed_tokens:
            seq.num_computed_tokens = num_computed_tokens
        if self.layout.has_sliding:
            passed = seq.unreachable(self.layout, self.block_size, seq.num_computed_tokens)
            if self.tiers is not None and passed:  # their copies below (an earlier turn's) go cold too
                self.tiers.on_window_passed([b.block_hash for _, _, b in passed if b.block_hash is not None])
            seq.release(self.pool, passed)

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` shares ``parent_id``'s tables (each block one more reference; null entries stay
        null) and its hash progress. The first write into a shared partial block copies it."""
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into {child_id}: it already has blocks")
        parent = self._seq(parent_id)
        self.pool.touch([block for _, _, block in parent.live()])
        self._seqs[child_id] = SeqBlocks(
            tables=[list(table) for table in parent.tables],
            root=parent.root,
            block_hashes=list(parent.block_hashes),
            num_cached_blocks=parent.num_cached_blocks,
            num_computed_tokens=parent.num_computed_tokens,
            num_released=list(parent.num_released),
            extra_keys=parent.extra_keys,
        )

    def free(self, seq_id: str) -> None:
        """Release ``seq_id``'s blocks, last position first (so its tail is evicted before its head),
        and forget the sequence. Freeing an unknown sequence (never allocated) does nothing."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free_blocks(seq.live_from_tail())
            if self.observer is not None:  # the eviction order the pool now has: tail first
                self.observer.on_freed(seq.cached_keys(self.layout.is_dense))
        swapped = self._swapped.pop(seq_id, None)
        if swapped is not None:
            assert self.tiers is not None
            self.tiers.release(swapped.out)

    # ---------------------------------------------------------------- swap preemption

    def swap_out(self, seq_id: str, num_computed_tokens: int) -> bool:
        """Preempt by swap: plan stores of the blocks holding ``num_computed_tokens`` tokens into the
        host tier (pinned there), then free the device blocks. A sliding group stores only its window's
        blocks. False, changing nothing, when there is no host tier or it has no room (the caller
        falls back to recomputation)."""
        if self.tiers is None:
            return False
        seq = self._seq(seq_id)
        bs = self.block_size
        num_blocks = min(-(-num_computed_tokens // bs), seq.num_blocks)
        firsts = tuple(
            min(g.first_reachable_block(num_computed_tokens, bs), num_blocks) for g in self.layout.groups
        )
        num_cached = min(seq.num_cached_blocks, num_blocks) if self.enable_caching else 0
        entries = seq.window_entries(firsts, num_blocks)
        blocks = [
            (b.block_id, group_key(seq.block_hashes[i], g) if i < num_cached else None) for g, i, b in entries
        ]
        out = self.tiers.swap_out(blocks, [g for g, _, _ in entries])
        if out is None:
            return False
        self.free(seq_id)
        self._swapped[seq_id] = Swapped(seq.without_tables(num_blocks), out, firsts, num_blocks)
        return True

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    def swap_in(
        self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int, num_new_tokens: int
    ) -> bool:
        """Resume a swapped-out sequence: fresh device blocks, loads from the host tier for the old
        ones, new ones for ``num_new_tokens``. False, changing nothing, if the pool is short."""
        swapped = self._swapped[seq_id]
        bs = self.block_size
        num_total = num_computed_tokens + num_new_tokens
        if swapped.num_blocks != -(-num_computed_tokens // bs) or num_total > len(token_ids):
            raise ValueError(f"{seq_id}: swap_in with {num_computed_tokens} computed tokens does not match")
        num_table = max(swapped.num_blocks, -(-num_total // bs))
        num_fresh = swapped.num_blocks_to_restore(num_table)
        if num_fresh > self.pool.num_free_blocks:
            return False
        assert self.tiers is not None
        del self._swapped[seq_id]
        tiers = self.tiers
        fresh = self.pool.get_new_blocks(num_fresh)
        swapped.restore(fresh, num_table, lambda ids: tiers.swap_in(swapped.out, ids))  # paired loads
        self.tiers.start_loads()
        seq = swapped.seq
        seq.num_computed_tokens = num_computed_tokens
        for g, i, block in seq.live():
            if i < seq.num_cached_blocks:
                key = group_key(seq.block_hashes[i], g)
                self._cache_block(block, key, token_ids[i * bs : (i + 1) * bs], g)
                self._origins[block.block_id] = (key, Medium.HOST)
        self._seqs[seq_id] = seq
        return True

    def forget_block(self, key: BlockHash) -> bool:
        """Drop ``key`` from the device prefix cache (its bytes were found wrong); True if it was there."""
        group = self.pool.group_of(key)
        if not self.pool.uncache(key):
            return False
        if self.listener is not None:
            self.listener.blocks_removed(Medium.DEVICE, [key], group)
        return True

    @property
    def num_planned_loads(self) -> int:
        """Host → device block loads this step's plan holds so far (every KV group's)."""
        return self.tiers.num_planned_loads if self.tiers is not None else 0

    def end_schedule_step(self) -> SwapPlan:
        """The swap plan accumulated since the last call: the scheduler takes it once per step."""
        return self.tiers.take_plan() if self.tiers is not None else SwapPlan()

    # ---------------------------------------------------------------- queries

    def _seq(self, seq_id: str) -> SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}: allocate_slots was never called or it was freed")
        return seq

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs or seq_id in self._swapped

    def block_ids(self, seq_id: str, group: int = 0) -> list[int]:
        """The sequence's block table in KV group ``group`` (a copy; null entries ``NULL_BLOCK_ID``)."""
        return self._seq(seq_id).block_ids()[group].tolist()

    def block_tables(self, seq_id: str) -> tuple[tuple[int, ...], ...]:
        """Every KV group's block table, in group order (``NULL_BLOCK_ID`` for null entries)."""
        return tuple(tuple(ids) for ids in self._seq(seq_id).block_ids())

    def step_tables(self, seq_id: str) -> tuple[array[int], ...]:
        """``block_tables`` as int64 arrays, what a step hands the runner: copies (one memcpy each) of ids
        kept up to date as the tables change, so a step pays no walk over its rows' blocks."""
        return tuple(ids[:] for ids in self._seq(seq_id).block_ids())

    def num_held_blocks(self, seq_id: str) -> int:
        """Blocks the sequence's tables reference now, over every group (null entries not counted)."""
        return self._seq(seq_id).num_held_blocks

    def num_blocks_in_use_by_group(self) -> tuple[int, ...]:
        """Distinct device blocks each KV group's tables hold now (a shared block counted once). One
        group: the pool's referenced blocks (O(1)); several: a walk over the live tables."""
        if self.layout.num_groups == 1:
            return (self.pool.num_blocks - self.pool.num_free_blocks,)
        return blocks_in_use_by_group(self._seqs.values(), self.layout.num_groups)

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """``(block_id, hash)`` of every device block holding cached KV (in use or idle)."""
        return [(b.block_id, b.block_hash) for b in self.pool.blocks if b.block_hash is not None]

    def block_map(self) -> tuple[list[BlockState], dict[int, Medium]]:
        """Each device block's state (by block id), and the tier the KV of the blocks loaded from below
        came from (any other block's was computed on the device). Read-only, O(num_blocks), allocating
        no object per block (a pool of 100k blocks in milliseconds): for the dashboard, not the step."""
        blocks = self.pool.blocks
        # The key check skips a stale entry (a loaded block that was not cached under its key).
        loaded = {i: medium for i, (key, medium) in self._origins.items() if blocks[i].block_hash == key}
        return self.pool.states(), loaded

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write ``(src_block_id, dst_block_id)`` pairs recorded since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks  # blocks available for new slots (free plus cached idle)

    def usage(self) -> float:
        return self.pool.usage  # the fraction of blocks referenced by some sequence

    def snapshot(self) -> TierSnapshot:
        """The device pool as a tier: its counters, and blocks in use or cached."""
        pool = self.pool
        used = pool.num_blocks - pool.num_free_blocks
        snap = TierSnapshot.of(Medium.DEVICE, self.device_counters, pool.num_blocks, used, self.block_size)
        snap.retained_blocks = pool.num_retained_blocks()
        return snap

    def check_integrity(self) -> None:
        """Pool invariants plus: table blocks in use, in one group's tables, null entries only before a
        sliding window, ``ref_cnt`` = the tables' references. Raises ``AssertionError``."""
        self.pool.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        check_seqs(self._seqs, self.layout, self.pool, self.block_size, self.enable_caching)
