"""The device block pool: reference counts, the free queue and the prefix-cache hash map.

A *block* holds the KV of ``block_size`` consecutive token slots. Every block is in exactly one
of three states::

    in use        ref_cnt > 0     out of the free queue    (maybe cached: shared by a prefix hit)
    cached idle   ref_cnt == 0    in the free queue        block_hash set, in the hash map
    free          ref_cnt == 0    in the free queue        block_hash None

A cached idle block keeps its KV: a later request with the same prefix takes it back out of the
middle of the free queue (``touch``) instead of recomputing it. It is only lost when the queue
hands it out again for new slots: that is *eviction*, and ``on_evict`` sees the block first (the
next tier stores its KV from there).

The free queue is an LRU list threaded through the blocks themselves, O(1) at both ends and in
the middle::

    head (evicted first)                                               tail (evicted last)
      │                                                                        │
      ▼                                                                        ▼
    ┌────┐ next  ┌────┐ next  ┌────┐       ┌────┐
    │ b7 │ ────► │ b2 │ ────► │ b5 │ ────► │ b0 │
    │    │ ◄──── │    │ ◄──── │    │ ◄──── │    │
    └────┘  prev └────┘  prev └────┘       └────┘
     free        free       cached idle   cached idle

    get_new_blocks  pops at the head        (evicting a cached block it pops)
    free_blocks     appends cached blocks at the tail, uncached ones at the head, cold ones to the cold queue
    touch           unlinks a cached idle block from anywhere

This module is pure Python: it knows block ids, never tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.kv.hashing import BlockHash
from kvtier.kv.retention import Retention, TierProtection


@dataclass(eq=False)
class KVBlock:
    """One block of the pool. Compared by identity (``eq=False``): two blocks are never "equal".

    ``ref_cnt``, ``block_hash``, ``token_ids`` and ``group`` are owned by :class:`BlockPool`; the links
    are owned by :class:`FreeBlockQueue`. Other code reads them and never writes them.
    """

    block_id: int
    ref_cnt: int = 0
    # Set only while the block is registered in the pool's hash map.
    block_hash: BlockHash | None = None
    # The tokens the block holds, kept next to the hash: a hash match with other tokens is a miss.
    token_ids: tuple[int, ...] | None = None
    # The KV group whose key ``block_hash`` is (kvtier/kv/groups.py); 0 while uncached.
    group: int = 0
    # Freed by a sliding group because its window moved past it (``free_blocks(cold=True)``): it waits
    # at the head of the free queue and the tiers keep it only where it displaces nothing.
    cold: bool = False
    # Freed while retained (kvtier/kv/retention.py): it waits in the retained queue, evicted last.
    retained: bool = False
    _prev: KVBlock | None = field(default=None, init=False, repr=False)
    _next: KVBlock | None = field(default=None, init=False, repr=False)


class FreeBlockQueue:
    """A doubly linked list of blocks through ``KVBlock._prev`` / ``_next``; the head leaves first.

    Every operation is O(1) except iteration. A block is in the queue iff it has a neighbour or is
    the only element; the queue never allocates a node of its own.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVBlock) -> bool:
        return block._prev is not None or block._next is not None or self._head is block

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail. Do not mutate the queue while iterating."""
        block = self._head
        while block is not None:
            yield block
            block = block._next

    def popleft(self) -> KVBlock:
        """Remove and return the head (the least recently freed block)."""
        block = self._head
        if block is None:
            raise IndexError("popleft from an empty FreeBlockQueue")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        """Insert at the tail (evicted last)."""
        if block in self:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block._prev = self._tail
        if self._tail is None:
            self._head = block
        else:
            self._tail._next = block
        self._tail = block
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        """Insert at the head (handed out first)."""
        if block in self:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block._next = self._head
        if self._head is None:
            self._tail = block
        else:
            self._head._prev = block
        self._head = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it is."""
        if block not in self:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        if block._prev is None:
            self._head = block._next
        else:
            block._prev._next = block._next
        if block._next is None:
            self._tail = block._prev
        else:
            block._next._prev = block._prev
        block._prev = None
        block._next = None
        self._len -= 1


BlockState = Literal["free", "cached", "in_use"]  # a block's state, as the dashboard draws it


class BlockPool:
    """All blocks of one device, their reference counts, and the hash map of cached blocks.

    ``on_evict(blocks)`` is called with the cached blocks a ``get_new_blocks`` is about to reuse for
    new slots (in eviction order, once per call), while they still have their ``block_hash``,
    ``token_ids`` and KV. It must not call back into the pool. If it raises, ``get_new_blocks`` raises
    and the pool is left unchanged.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        on_evict: Callable[[list[KVBlock]], None] | None = None,
        retention: Retention | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self.blocks: list[KVBlock] = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free_queue = FreeBlockQueue(self.blocks)  # uncached blocks at the head, warm cached ones after
        self._cold_queue = FreeBlockQueue()  # cold cached blocks, oldest first: taken after the uncached
        self._retained_queue = FreeBlockQueue()  # retained cached blocks (at most the cap): taken last
        self.retention = retention
        self._retained_cap = 0 if retention is None else retention.cap(num_blocks)
        self._next_expiry_check = float("-inf")
        self._retained_count = TierProtection(retention, 0)  # only its throttled count is used
        self._cached: dict[BlockHash, KVBlock] = {}

    # ---------------------------------------------------------------- counters

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``get_new_blocks`` can hand out: free ones plus cached idle ones."""
        return len(self._free_queue) + len(self._cold_queue) + len(self._retained_queue)

    def states(self) -> list[BlockState]:
        """Each block's state, by block id: referenced, idle with cached KV, or free. O(num_blocks)."""
        return [
            "in_use" if b.ref_cnt > 0 else "free" if b.block_hash is None else "cached" for b in self.blocks
        ]

    def num_retained_blocks(self) -> int:
        """Cached blocks (in use or idle) under retention now; for metrics (at most once a second)."""
        return self._retained_count.count(self._cached)

    @property
    def num_retained_idle(self) -> int:
        """Idle cached blocks kept back as retained (evicted after every other free block)."""
        return len(self._retained_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the hash map, in use or idle."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks with ``ref_cnt > 0``."""
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def free_queue_block_ids(self) -> list[int]:
        """The free blocks, next to go first. For tests and debugging: O(num_free_blocks)."""
        return [block.block_id for block in self.free_order()]

    def free_order(self) -> Iterator[KVBlock]:
        """Free blocks in the order ``get_new_blocks`` takes them: uncached, cold, warm (LRU), retained."""
        warm = iter(self._free_queue)
        for block in warm:
            if block.block_hash is not None:
                yield from self._cold_queue
                yield block
                yield from warm
                yield from self._retained_queue
                return
            yield block
        yield from self._cold_queue
        yield from self._retained_queue

    def _queue_of(self, block: KVBlock) -> FreeBlockQueue:
        if block.retained:
            return self._retained_queue
        return self._cold_queue if block.cold else self._free_queue

    def _expire_retained(self) -> None:
        """Idle retained blocks whose retention ran out rejoin the LRU (at most once a second)."""
        if self.retention is None or not self._retained_queue:
            return
        now = self.retention.clock()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + 1.0
        for block in [b for b in self._retained_queue if not self.retention.is_retained(b.block_hash)]:
            self._retained_queue.remove(block)
            block.retained = False
            self._free_queue.append(block)

    def _retains(self, block: KVBlock) -> bool:
        """Whether a cached block falling idle waits in the retained queue (retained, and room under
        the cap; an expired one found there is evicted in its turn all the same)."""
        return (
            self.retention is not None
            and block.block_hash is not None
            and len(self._retained_queue) < self._retained_cap
            and self.retention.is_retained(block.block_hash)
        )

    # ---------------------------------------------------------------- allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` blocks off the free queue head, with ``ref_cnt`` 1, evicting cached ones.

        Raises ``ValueError`` (and changes nothing) if fewer than ``num_blocks`` are free.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"need {num_blocks} free blocks, only {self.num_free_blocks} available")
        self._expire_retained()
        taken = list(itertools.islice(self.free_order(), num_blocks))
        # Notify first, mutate after: a hook that raises leaves the pool as it was.
        if self.on_evict is not None:
            evicted = [block for block in taken if block.block_hash is not None]
            if evicted:
                self.on_evict(evicted)
        for block in taken:
            self._queue_of(block).remove(block)
        blocks = taken
        for block in blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                block.token_ids = None
                block.group = 0
            block.cold = block.retained = False
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to each block (a prefix hit or a fork).

        A block at ``ref_cnt`` 0 (cached idle) is unlinked from the free queue in O(1).
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self._queue_of(block).remove(block)
                block.cold = block.retained = False
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock], cold: bool = False) -> None:
        """Drop one reference to each block; blocks reaching 0 go back to the free queue.

        Cached blocks are appended at the tail *in the order given* and stay in the hash map until
        evicted; callers pass a sequence's blocks last-first so its tail blocks are evicted first
        (its head blocks are the ones most likely shared by later requests). Uncached blocks hold
        nothing anyone can ask for again, so they go to the head and are reused before any cached
        block is evicted. ``cold`` blocks (a sliding group's, out of the window of the sequence that
        freed them: a hit needs them only for a prefix ending within a window of them) wait, cached, in
        a queue of their own that is taken after the uncached blocks and before any other cached one,
        so the blocks a returning prompt needs outlive them. A retained cached block (``retention``)
        waits in the retained queue, taken after every other.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.cold = cold and block.block_hash is not None
                block.retained = not block.cold and self._retains(block)
                if block.retained:
                    self._retained_queue.append(block)
                elif block.cold:
                    self._cold_queue.append(block)
                elif block.block_hash is None:
                    self._free_queue.appendleft(block)
                else:
                    self._free_queue.append(block)

    # ---------------------------------------------------------------- prefix cache

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for ``block_hash``, or None. Does not take a reference.

        The stored tokens must equal ``token_ids`` too: with a (practically impossible, but cheap to
        rule out) hash collision the lookup is a miss rather than a wrong answer.
        """
        if not self.enable_caching:
            return None
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(
        self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int], group: int = 0
    ) -> bool:
        """Register a full, computed block under ``block_hash`` (a key of KV group ``group``). Returns
        whether it was registered.

        If another block already holds that hash (two sequences computed the same prefix at the
        same time), the map is left as is: this block stays uncached and is simply freed later.
        """
        if not self.enable_caching:
            return False
        if block.ref_cnt <= 0:
            raise ValueError(f"cannot cache block {block.block_id}: it is not in use")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.group = group
        self._cached[block_hash] = block
        return True

    def uncache(self, block_hash: BlockHash) -> bool:
        """Take ``block_hash`` out of the hash map (the canary found its bytes wrong): no lookup finds
        it again. An idle block becomes free (reused first); one in use stays with its sequences."""
        block = self._cached.pop(block_hash, None)
        if block is None:
            return False
        block.block_hash = None
        block.token_ids = None
        block.group = 0
        if block.ref_cnt == 0:
            self._queue_of(block).remove(block)
            block.cold = False
            self._free_queue.appendleft(block)
        return True

    def group_of(self, block_hash: BlockHash) -> int:
        """The KV group of the cached block under ``block_hash`` (0 when none is cached)."""
        block = self._cached.get(block_hash)
        return 0 if block is None else block.group

    # ---------------------------------------------------------------- checks

    def _check_queue(self, queue: FreeBlockQueue, seen: set[int], cold: bool, retained: bool = False) -> None:
        """One free queue's links, each block in it once; a cold block (cached) in the cold queue only,
        a retained one in the retained queue only."""
        prev: KVBlock | None = None
        block = queue._head
        num_linked = 0
        while block is not None:
            assert block.block_id not in seen, f"block {block.block_id} appears twice in the free queues"
            assert len(seen) < len(self.blocks), "free queues are longer than the pool (a cycle?)"
            assert self.blocks[block.block_id] is block, f"free queue holds foreign block {block.block_id}"
            assert block._prev is prev, f"block {block.block_id}: prev link does not match its predecessor"
            assert block.cold == cold, f"block {block.block_id} (cold={block.cold}) in the wrong free queue"
            assert block.retained == retained, f"block {block.block_id} (retained={block.retained}) misplaced"
            assert not (cold or retained) or block.block_hash is not None, (
                f"block {block.block_id} is uncached"
            )
            seen.add(block.block_id)
            num_linked += 1
            prev = block
            block = block._next
        assert queue._tail is prev, "free queue tail is not its last block"
        assert num_linked == len(queue), f"free queue length {len(queue)} but {num_linked} blocks linked"

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of the pool."""
        seen: set[int] = set()
        for queue, cold in ((self._free_queue, False), (self._cold_queue, True)):
            self._check_queue(queue, seen, cold)
        self._check_queue(self._retained_queue, seen, False, retained=True)

        num_free = num_cached_idle = num_in_use = 0
        for block in self.blocks:
            in_queue = block.block_id in seen
            if in_queue:
                assert block.ref_cnt == 0, (
                    f"block {block.block_id} is in the free queue with ref_cnt {block.ref_cnt}"
                )
            else:
                assert block._prev is None and block._next is None, f"block {block.block_id} has stale links"
                assert block.ref_cnt > 0, (
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but is not free"
                )
            if block.block_hash is None:
                assert block.token_ids is None, f"uncached block {block.block_id} still has token_ids"
            else:
                assert self._cached.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash but the hash map does not point to it"
                )
                assert block.token_ids is not None, f"cached block {block.block_id} has no token_ids"
            if block.ref_cnt > 0:
                num_in_use += 1
            elif block.block_hash is None:
                num_free += 1
            else:
                num_cached_idle += 1
        assert num_free + num_cached_idle + num_in_use == len(self.blocks), "block states do not add up"
        assert num_free + num_cached_idle == self.num_free_blocks, "free queues != free + cached idle blocks"

        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, (
                f"hash map entry points to block {block.block_id} whose block_hash differs"
            )
        if not self.enable_caching:
            assert not self._cached, "caching is disabled but the hash map is not empty"
