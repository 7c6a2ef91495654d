"""``KVCacheManager``: per-sequence block tables over one :class:`BlockPool`.

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

Preemption by recomputation is ``free`` now and a fresh lookup later; the sequence's full blocks
stay cached idle in the free queue, so if nothing evicted them the recomputation is mostly hits.

Writers never share a block: before slots are written, ``allocate_slots`` gives the writing
sequence a private copy of any block another sequence also references (copy-on-write, after a
fork) and records ``(src_block_id, dst_block_id)``; the worker must apply those copies (from
``take_block_copies``) before the step's forward pass writes KV.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvtier.kv.block_pool import BlockPool, KVBlock
from kvtier.kv.hashing import BlockHash, ExtraKey, extend_block_hashes, hash_block, root_hash
from kvtier.kv.lower import NO_LOWER_HIT, BlockListener, LowerHit, LowerTiers, SwappedOut
from kvtier.kv.plan import SwapPlan
from kvtier.stats import Medium, TierCounters, TierSnapshot


@dataclass(frozen=True)
class ComputedBlocks:
    """Result of a prefix lookup: cached blocks covering a prompt's leading tokens. Owned by no one
    until ``allocate_slots`` adopts it, so use it in the same scheduling decision that made it.

    The device hits come first, then the blocks a lower tier holds (``lower.host_keys``: loaded into
    fresh device blocks by this step's swap plan)::

        prompt blocks   | b0  b1  b2 | b3  b4 | b5  b6  (b7 ...)
                          device hits  host     on disk, being   computed
                          block_ids    hits     read (pending)
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

    def tokens_by_tier(self, block_size: int) -> dict[Medium, int]:
        """Prompt tokens this hit serves, by the tier they come from (every medium, zeros included)."""
        blocks = {Medium.DEVICE: len(self.block_ids), **self.lower.blocks_by_tier()}
        return {medium: blocks.get(medium, 0) * block_size for medium in Medium}


NO_COMPUTED_BLOCKS = ComputedBlocks(block_ids=(), num_computed_tokens=0)

BlockState = Literal["free", "cached", "in_use"]  # the block pool's three states (see block_pool.py)


@dataclass(frozen=True)
class AdoptedPrefix:
    """What one adopted lookup touched, for an :class:`AccessObserver` (``kvtier/insight``)."""

    keys: tuple[BlockHash, ...]  # every full prompt block looked up, in order; the hits lead
    served_by: tuple[Medium, ...]  # the tier of each hit block (device, host, disk, ...)
    block_ids: tuple[int, ...]  # the device blocks holding the hits now (loads land this step)


class AccessObserver(Protocol):
    """Told of every adopted prefix lookup, of every block newly entered into the device cache, and of
    a sequence's cached blocks when it frees them (the miss-ratio trackers and the canary); called on
    the scheduler's thread, must be cheap."""

    def on_adopt(self, seq_id: str, token_ids: Sequence[int], adopted: AdoptedPrefix) -> None: ...
    def on_cached(self, keys: Sequence[BlockHash]) -> None: ...
    def on_freed(self, keys: Sequence[BlockHash]) -> None: ...


@dataclass
class KVCacheStats:
    """Prompt tokens since the manager was created, counted when a lookup's hit is adopted (the
    device pool's own block counters are ``KVCacheManager.device_counters``)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of those, tokens served by any tier


def blocks_to_allocate(num_table_blocks: int, num_total_tokens: int, block_size: int) -> int:
    """Fresh blocks a table of ``num_table_blocks`` needs to cover ``num_total_tokens`` slots."""
    return max(0, -(-num_total_tokens // block_size) - num_table_blocks)


@dataclass
class _SeqBlocks:
    """What the manager knows about one live sequence."""

    blocks: list[KVBlock]
    root: BlockHash
    # block_hashes[i] is the chained hash of block i; grows as blocks become full and computed.
    block_hashes: list[BlockHash]
    # Blocks [0, num_cached_blocks) have been offered to the hash map (a duplicate may have lost).
    num_cached_blocks: int


@dataclass
class _Swapped:
    """A sequence preempted by swap: its hash progress, and its blocks pinned in the host tier."""

    seq: _SeqBlocks  # with no device blocks
    out: SwappedOut


class KVCacheManager:
    """Block tables for live sequences, prefix reuse, copy-on-write after fork."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        on_evict: Callable[[KVBlock], None] | None = None,
        tiers: LowerTiers | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.stats = KVCacheStats()
        self.device_counters = TierCounters()  # lookups, hits and evictions of the device pool
        self._on_evict = on_evict
        self.tiers = tiers
        # KV events: told when a block enters the device prefix cache and when it is evicted from it.
        self.listener: BlockListener | None = None
        self.observer: AccessObserver | None = None  # block-key accesses (kvtier/insight)
        self.device_quarantined = False  # the canary caught a bad device hit: no prefix reuse at all
        self.pool = BlockPool(num_blocks, enable_caching, on_evict=self._evicted)
        self._seqs: dict[str, _SeqBlocks] = {}
        self._swapped: dict[str, _Swapped] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # Device blocks whose KV was loaded from a lower tier: block_id -> (the key it was loaded under,
        # that tier). Absent: computed on the device. Only read by ``block_map``; dropped on eviction.
        self._origins: dict[int, tuple[BlockHash, Medium]] = {}

    def _evicted(self, block: KVBlock) -> None:
        self._origins.pop(block.block_id, None)
        if self._on_evict is not None:
            self._on_evict(block)
        if self.tiers is not None and block.block_hash is not None:
            self.tiers.on_device_evict(block.block_id, block.block_hash)
        self.device_counters.blocks_evicted += 1
        if self.listener is not None and block.block_hash is not None:
            self.listener.blocks_removed(Medium.DEVICE, [block.block_hash])

    def _cache_block(self, block: KVBlock, key: BlockHash, token_ids: Sequence[int]) -> None:
        """Enter ``block`` into the device prefix cache under ``key`` (announced when it is new)."""
        if self.pool.cache_block(block, key, token_ids) and self.listener is not None:
            self.listener.blocks_stored(Medium.DEVICE, [key])

    # ---------------------------------------------------------------- lookup

    def get_computed_blocks(
        self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...]
    ) -> ComputedBlocks:
        """The longest cached prefix of full blocks of ``token_ids``; takes no reference.

        Never covers the whole prompt: at most ``(len(token_ids) - 1) // block_size`` blocks, so at
        least the last token is computed and produces logits. Stops at the first miss (a later
        block cannot be valid without its parent). After the device misses, the lower tiers are
        asked for the following blocks (``ComputedBlocks.lower``); that may start disk reads.
        Takes no reference and counts nothing: ``allocate_slots`` counts the hit it adopts.
        """
        if not self.enable_caching or self.device_quarantined:
            return NO_COMPUTED_BLOCKS
        bs = self.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        block_ids: list[int] = []
        block_hashes: list[BlockHash] = []
        parent = root_hash(extra_keys)
        for i in range(max_blocks):
            block_tokens = token_ids[i * bs : (i + 1) * bs]
            parent = hash_block(parent, block_tokens)
            block = self.pool.get_cached_block(parent, block_tokens)
            if block is None:
                break
            block_ids.append(block.block_id)
            block_hashes.append(parent)
        lower = NO_LOWER_HIT
        if self.tiers is not None and len(block_ids) < max_blocks:
            rest = list(block_hashes)
            extend_block_hashes(rest, token_ids, bs, root_hash(extra_keys), max_blocks * bs)
            lower = self.tiers.lookup(rest[len(block_ids) :])
            block_hashes.extend(lower.host_keys)
        num_computed_tokens = (len(block_ids) + len(lower.host_keys)) * bs
        return ComputedBlocks(
            tuple(block_ids), num_computed_tokens, tuple(block_hashes), lower, len(token_ids), max_blocks
        )

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
        """Make ``seq_id``'s table cover slots ``[0, num_computed_tokens + num_new_tokens)``.

        On the sequence's first call the ``computed`` blocks (if any) become its table prefix and
        ``num_computed_tokens`` must equal ``computed.num_computed_tokens``; ``extra_keys`` fixes
        the root of its hash chain. Returns False, changing nothing, if the pool cannot supply the
        blocks needed: new blocks, copy-on-write copies, and idle hit blocks taken off the queue.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"negative token counts: computed={num_computed_tokens} new={num_new_tokens}")
        num_total = num_computed_tokens + num_new_tokens
        if num_total > len(token_ids):
            raise ValueError(
                f"{seq_id}: {num_total} slots requested but the sequence has {len(token_ids)} tokens"
            )
        seq = self._seqs.get(seq_id)
        if seq is None:
            computed = computed or NO_COMPUTED_BLOCKS
            if num_computed_tokens != computed.num_computed_tokens:
                raise ValueError(
                    f"{seq_id}: first allocation with num_computed_tokens={num_computed_tokens}, but the "
                    f"adopted prefix covers {computed.num_computed_tokens}"
                )
            return self._adopt(seq_id, token_ids, computed, num_new_tokens, extra_keys)
        if computed is not None and computed.block_ids:
            raise ValueError(f"{seq_id}: prefix blocks can only be adopted on the first allocation")
        if num_computed_tokens > len(seq.blocks) * self.block_size:
            raise ValueError(
                f"{seq_id}: {num_computed_tokens} computed tokens but the table covers "
                f"{len(seq.blocks) * self.block_size}"
            )
        return self._grow(seq, num_computed_tokens, num_new_tokens)

    def _adopt(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        computed: ComputedBlocks,
        num_new_tokens: int,
        extra_keys: tuple[ExtraKey, ...],
    ) -> bool:
        """A new sequence's first allocation: the prefix hit becomes its table (device hits shared,
        host hits loaded into fresh blocks), then fresh blocks for its new slots."""
        hit_blocks = self._check_fresh(seq_id, computed)
        load_keys = computed.lower.host_keys
        num_idle_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)  # taken off the free queue
        num_fresh = blocks_to_allocate(
            len(hit_blocks) + len(load_keys), computed.num_computed_tokens + num_new_tokens, self.block_size
        )
        if len(load_keys) + num_fresh + num_idle_hits > self.pool.num_free_blocks:
            return False
        # Feasible: from here on nothing fails. Touch hits first so new blocks cannot evict them, and
        # hold host hits so write-back stores (evictions below) cannot push them out of the host tier.
        self._count_lookup(computed)
        self.pool.touch(hit_blocks)
        if load_keys:
            assert self.tiers is not None
            self.tiers.hold(load_keys)
        seq = _SeqBlocks(
            blocks=list(hit_blocks),
            root=root_hash(extra_keys),
            block_hashes=[block.block_hash for block in hit_blocks if block.block_hash is not None],
            num_cached_blocks=len(hit_blocks) + len(load_keys),
        )
        self._seqs[seq_id] = seq
        fresh = self.pool.get_new_blocks(len(load_keys) + num_fresh)
        if load_keys:
            self._load_into(seq, token_ids, computed.lower, fresh[: len(load_keys)])
        seq.blocks.extend(fresh[len(load_keys) :])
        if self.observer is not None:
            self._observe_adopt(seq_id, token_ids, computed, seq, extra_keys)
        return True

    def _observe_adopt(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        computed: ComputedBlocks,
        seq: _SeqBlocks,
        extra_keys: tuple[ExtraKey, ...],
    ) -> None:
        """Tell the observer every full prompt block looked up (hits first) and where the hits came from."""
        assert self.observer is not None
        keys = list(computed.block_hashes)
        extend_block_hashes(
            keys, token_ids, self.block_size, seq.root, computed.num_lookup_blocks * self.block_size
        )
        lower = computed.lower
        served = [Medium.DEVICE] * len(computed.block_ids)
        served += [lower.source_of(i) for i in range(len(lower.host_keys))]
        num_hits = len(served)
        hit_ids = tuple(block.block_id for block in seq.blocks[:num_hits])
        self.observer.on_adopt(seq_id, token_ids, AdoptedPrefix(tuple(keys), tuple(served), hit_ids))

    def _check_fresh(self, seq_id: str, computed: ComputedBlocks) -> list[KVBlock]:
        """The device hit blocks of ``computed``; raises if the lookup went stale (a block evicted since)."""
        if seq_id in self._swapped:
            raise ValueError(f"{seq_id} is swapped out: resume it with swap_in")
        num_blocks = len(computed.block_ids) + len(computed.lower.host_keys)
        if computed.num_computed_tokens != num_blocks * self.block_size:
            raise ValueError(f"{seq_id}: ComputedBlocks covers a partial block")
        hit_blocks = [self.pool.blocks[block_id] for block_id in computed.block_ids]
        for block, expected in zip(hit_blocks, computed.block_hashes, strict=False):
            if block.block_hash is None or block.block_hash != expected:
                raise ValueError(
                    f"{seq_id}: stale ComputedBlocks: block {block.block_id} was evicted after the lookup"
                )
        if any(block.block_hash is None for block in hit_blocks):
            raise ValueError(f"{seq_id}: stale ComputedBlocks: a hit block holds no cached KV")
        load_keys = computed.lower.host_keys
        if load_keys and (self.tiers is None or not self.tiers.can_load(load_keys)):
            raise ValueError(f"{seq_id}: stale ComputedBlocks: a host block was evicted after the lookup")
        return hit_blocks

    def _load_into(
        self, seq: _SeqBlocks, token_ids: Sequence[int], hit: LowerHit, blocks: list[KVBlock]
    ) -> None:
        """Plan loads of the host-tier keys of ``hit`` into fresh ``blocks`` appended to the table; they
        are cached under their keys at once (the step's plan fills them before any forward reads them)."""
        assert self.tiers is not None
        bs = self.block_size
        keys = hit.host_keys
        self.tiers.load(keys, [block.block_id for block in blocks])
        first = len(seq.blocks)
        for j, (block, key) in enumerate(zip(blocks, keys, strict=True)):
            i = first + j
            self._cache_block(block, key, token_ids[i * bs : (i + 1) * bs])
            self._origins[block.block_id] = (key, hit.source_of(j))
        seq.blocks.extend(blocks)
        seq.block_hashes.extend(keys)

    def _grow(self, seq: _SeqBlocks, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """A live sequence's next slots: private copies of shared blocks they write into (after a
        fork), then fresh blocks past the end of its table."""
        bs = self.block_size
        num_total = num_computed_tokens + num_new_tokens
        shared: list[int] = []  # table indices written this step that another sequence references
        if num_new_tokens > 0:
            last = min((num_total - 1) // bs, len(seq.blocks) - 1)
            shared = [i for i in range(num_computed_tokens // bs, last + 1) if seq.blocks[i].ref_cnt > 1]
        num_fresh = blocks_to_allocate(len(seq.blocks), num_total, bs)
        if len(shared) + num_fresh > self.pool.num_free_blocks:
            return False
        fresh = self.pool.get_new_blocks(len(shared) + num_fresh)
        for i, dst in zip(shared, fresh, strict=False):
            src = seq.blocks[i]
            self._pending_copies.append((src.block_id, dst.block_id))
            seq.blocks[i] = dst
            self.pool.free_blocks([src])  # ref_cnt was > 1: stays in use by the other sequence(s)
        seq.blocks.extend(fresh[len(shared) :])
        return True

    def _count_lookup(self, computed: ComputedBlocks) -> None:
        st = self.stats
        st.prefix_cache_queries += computed.num_lookup_tokens
        st.prefix_cache_hits += computed.num_computed_tokens
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
        """Register every block of ``seq_id`` that is now full and computed in the hash map.

        Called after a step computed KV for ``token_ids[:num_computed_tokens]``. The chained hashes
        are kept per sequence and extended, never recomputed from block 0. The chain's root was
        fixed by the first ``allocate_slots``; non-empty ``extra_keys`` are checked against it.
        """
        if not self.enable_caching:
            return
        seq = self._seq(seq_id)
        if num_computed_tokens > len(token_ids):
            raise ValueError(
                f"{seq_id}: {num_computed_tokens} computed tokens but only {len(token_ids)} tokens"
            )
        if extra_keys and root_hash(extra_keys) != seq.root:
            raise ValueError(f"{seq_id}: extra_keys differ from the ones of its first allocation")
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(seq.blocks))
        if num_full <= seq.num_cached_blocks:
            return
        if len(seq.block_hashes) < num_full:
            extend_block_hashes(seq.block_hashes, token_ids, bs, seq.root, num_full * bs)
        for i in range(seq.num_cached_blocks, num_full):
            block = seq.blocks[i]
            self._cache_block(block, seq.block_hashes[i], token_ids[i * bs : (i + 1) * bs])
            if self.tiers is not None:
                self.tiers.on_block_full(block.block_id, seq.block_hashes[i])
        if self.observer is not None:
            self.observer.on_cached(seq.block_hashes[seq.num_cached_blocks : num_full])
        seq.num_cached_blocks = num_full

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` shares ``parent_id``'s whole table (each block one more reference) and its
        hash progress. The first write into a shared partial block copies it (see allocate_slots)."""
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into {child_id}: it already has blocks")
        parent = self._seq(parent_id)
        self.pool.touch(parent.blocks)
        self._seqs[child_id] = _SeqBlocks(
            blocks=list(parent.blocks),
            root=parent.root,
            block_hashes=list(parent.block_hashes),
            num_cached_blocks=parent.num_cached_blocks,
        )

    def free(self, seq_id: str) -> None:
        """Release ``seq_id``'s blocks, last block first (so its tail is evicted before its head), and
        forget the sequence. Freeing an unknown sequence (never allocated) does nothing."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free_blocks(reversed(seq.blocks))
            if self.observer is not None:  # the eviction order the pool now has: tail first
                self.observer.on_freed(seq.block_hashes[: seq.num_cached_blocks])
        swapped = self._swapped.pop(seq_id, None)
        if swapped is not None:
            assert self.tiers is not None
            self.tiers.release(swapped.out)

    # ---------------------------------------------------------------- swap preemption

    def swap_out(self, seq_id: str, num_computed_tokens: int) -> bool:
        """Preempt by swap: plan stores of the blocks holding ``num_computed_tokens`` tokens into the
        host tier (pinned there), then free the device blocks. False, changing nothing, when there
        is no host tier or it has no room (the caller falls back to recomputation)."""
        if self.tiers is None:
            return False
        seq = self._seq(seq_id)
        num_blocks = -(-num_computed_tokens // self.block_size)
        blocks = [
            (
                block.block_id,
                seq.block_hashes[i] if i < seq.num_cached_blocks and self.enable_caching else None,
            )
            for i, block in enumerate(seq.blocks[:num_blocks])
        ]
        out = self.tiers.swap_out(blocks)
        if out is None:
            return False
        self.free(seq_id)
        self._swapped[seq_id] = _Swapped(
            _SeqBlocks([], seq.root, list(seq.block_hashes), min(seq.num_cached_blocks, num_blocks)), out
        )
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
        num_loads = len(swapped.out.keys)
        num_total = num_computed_tokens + num_new_tokens
        if num_loads != -(-num_computed_tokens // bs) or num_total > len(token_ids):
            raise ValueError(f"{seq_id}: swap_in with {num_computed_tokens} computed tokens does not match")
        num_blocks = max(num_loads, -(-num_total // bs))
        if num_blocks > self.pool.num_free_blocks:
            return False
        assert self.tiers is not None
        del self._swapped[seq_id]
        fresh = self.pool.get_new_blocks(num_blocks)
        self.tiers.swap_in(swapped.out, [block.block_id for block in fresh[:num_loads]])
        seq = swapped.seq
        seq.blocks = fresh
        for i in range(seq.num_cached_blocks):
            self._cache_block(fresh[i], seq.block_hashes[i], token_ids[i * bs : (i + 1) * bs])
            self._origins[fresh[i].block_id] = (seq.block_hashes[i], Medium.HOST)
        self._seqs[seq_id] = seq
        return True

    def forget_block(self, key: BlockHash) -> bool:
        """Drop ``key`` from the device prefix cache (its bytes were found wrong); True if it was there."""
        if not self.pool.uncache(key):
            return False
        if self.listener is not None:
            self.listener.blocks_removed(Medium.DEVICE, [key])
        return True

    def end_schedule_step(self) -> SwapPlan:
        """The swap plan accumulated since the last call: the scheduler takes it once per step."""
        return self.tiers.take_plan() if self.tiers is not None else SwapPlan()

    # ---------------------------------------------------------------- queries

    def _seq(self, seq_id: str) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}: allocate_slots was never called or it was freed")
        return seq

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs or seq_id in self._swapped

    def block_ids(self, seq_id: str) -> list[int]:
        """The sequence's current block table (a copy)."""
        return [block.block_id for block in self._seq(seq_id).blocks]

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """``(block_id, hash)`` of every device block holding cached KV (in use or idle)."""
        return [(b.block_id, b.block_hash) for b in self.pool.blocks if b.block_hash is not None]

    def block_map(self) -> tuple[list[BlockState], dict[int, Medium]]:
        """Each device block's state (by block id), and the tier the KV of the blocks loaded from below
        came from (any other block's was computed on the device). Read-only, O(num_blocks), allocating
        no object per block (a pool of 100k blocks in milliseconds): for the dashboard, not the step."""
        blocks = self.pool.blocks
        states: list[BlockState] = [
            "in_use" if b.ref_cnt > 0 else "free" if b.block_hash is None else "cached" for b in blocks
        ]
        # The key check skips a stale entry (a loaded block that was not cached under its key).
        loaded = {i: medium for i, (key, medium) in self._origins.items() if blocks[i].block_hash == key}
        return states, loaded

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write ``(src_block_id, dst_block_id)`` pairs recorded since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def num_free_blocks(self) -> int:
        """Blocks available for new slots (free plus cached idle)."""
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return self.pool.usage

    def snapshot(self) -> TierSnapshot:
        """The device pool as a tier: its counters, and blocks in use or cached."""
        pool = self.pool
        used = pool.num_blocks - pool.num_free_blocks
        return TierSnapshot.of(Medium.DEVICE, self.device_counters, pool.num_blocks, used, self.block_size)

    def check_integrity(self) -> None:
        """Pool invariants plus: every table block is in use, and each block's ``ref_cnt`` equals the
        number of references the tables hold to it. Raises ``AssertionError``."""
        self.pool.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        refs: Counter[int] = Counter()
        for seq_id, seq in self._seqs.items():
            ids = [block.block_id for block in seq.blocks]
            assert len(set(ids)) == len(ids), f"{seq_id}: a block appears twice in its table"
            assert seq.num_cached_blocks <= len(seq.blocks), f"{seq_id}: more cached blocks than blocks"
            if self.enable_caching:
                assert seq.num_cached_blocks <= len(seq.block_hashes), f"{seq_id}: cached blocks without hash"
            for i, block in enumerate(seq.blocks):
                assert self.pool.blocks[block.block_id] is block, f"{seq_id}: foreign block {block.block_id}"
                assert block.ref_cnt > 0, f"{seq_id}: table holds block {block.block_id} with ref_cnt 0"
                # A fork child may not have hashed a block its parent cached since; if it has, they agree.
                if block.block_hash is not None and i < len(seq.block_hashes):
                    assert seq.block_hashes[i] == block.block_hash, (
                        f"{seq_id}: block {block.block_id} is cached under a hash other than the sequence's"
                    )
            refs.update(ids)
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs[block.block_id]} table references"
            )
