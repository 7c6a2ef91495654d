"""BlockPool and FreeBlockQueue: reference counts, LRU eviction, the hash map and its guards."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvtier.kv.hashing import BlockHash, hash_block, root_hash

ROOT = root_hash(("fp",))


def h(*token_ids: int) -> BlockHash:
    return hash_block(ROOT, token_ids)


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------- FreeBlockQueue


def test_queue_is_fifo_and_removes_from_the_middle() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5 and ids(list(queue)) == [0, 1, 2, 3, 4]

    queue.remove(blocks[2])  # middle
    queue.remove(blocks[0])  # head
    queue.remove(blocks[4])  # tail
    assert ids(list(queue)) == [1, 3] and len(queue) == 2
    assert blocks[2] not in queue and blocks[3] in queue

    queue.append(blocks[2])
    queue.appendleft(blocks[4])
    assert ids(list(queue)) == [4, 1, 3, 2]
    assert ids([queue.popleft() for _ in range(4)]) == [4, 1, 3, 2]
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_queue_refuses_double_insert_and_foreign_remove() -> None:
    a, b = KVBlock(0), KVBlock(1)
    queue = FreeBlockQueue([a])
    with pytest.raises(ValueError):
        queue.append(a)
    with pytest.raises(ValueError):
        queue.appendleft(a)
    with pytest.raises(ValueError):
        queue.remove(b)
    queue.remove(a)  # the only element: membership must still have been detected
    assert len(queue) == 0


# ---------------------------------------------------------------- BlockPool


def test_fresh_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(4, enable_caching=True)
    assert pool.num_blocks == 4 and pool.num_free_blocks == 4 and pool.usage == 0.0
    assert pool.free_queue_block_ids() == [0, 1, 2, 3]
    assert ids(pool.get_new_blocks(3)) == [0, 1, 2]
    assert pool.usage == 0.75 and all(b.ref_cnt == 1 for b in pool.blocks[:3])
    pool.check_integrity()


def test_get_new_blocks_fails_cleanly_when_short() -> None:
    pool = BlockPool(2, enable_caching=True)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    assert pool.num_free_blocks == 1 and pool.get_new_blocks(0) == []
    pool.check_integrity()


def test_story_cache_free_hit_touch_evict() -> None:
    """A caches two blocks and finishes; B hits one of them from the middle of the free queue;
    C needs more than the uncached free blocks, so the LRU cached idle block is evicted."""
    evicted: list[tuple[int, BlockHash | None, tuple[int, ...] | None]] = []
    pool = BlockPool(
        6,
        enable_caching=True,
        on_evict=lambda blocks: evicted.extend((b.block_id, b.block_hash, b.token_ids) for b in blocks),
    )

    a = pool.get_new_blocks(3)  # blocks 0, 1, 2: two full ones + a partial one
    assert pool.cache_block(a[0], h(1, 2), [1, 2])
    assert pool.cache_block(a[1], hash_block(h(1, 2), [3, 4]), [3, 4])
    assert pool.num_cached_blocks == 2
    pool.free_blocks(reversed(a))
    # Uncached partial block 2 goes to the head; cached ones to the tail, tail block first.
    assert pool.free_queue_block_ids() == [2, 3, 4, 5, 1, 0]
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 2  # cached idle blocks stay findable
    pool.check_integrity()

    hit = pool.get_cached_block(h(1, 2), [1, 2])
    assert hit is a[0]
    pool.touch([hit])  # pulled out of the middle of the queue
    assert hit.ref_cnt == 1 and pool.free_queue_block_ids() == [2, 3, 4, 5, 1]
    pool.check_integrity()

    c = pool.get_new_blocks(5)  # 4 uncached free + the LRU cached idle block 1
    assert ids(c) == [2, 3, 4, 5, 1]
    assert evicted == [(1, hash_block(h(1, 2), [3, 4]), (3, 4))]  # hook saw the block before clearing
    assert c[-1].block_hash is None and c[-1].token_ids is None
    assert pool.get_cached_block(hash_block(h(1, 2), [3, 4]), [3, 4]) is None
    assert pool.num_free_blocks == 0 and pool.usage == 1.0 and pool.num_cached_blocks == 1
    pool.check_integrity()


def test_shared_block_returns_to_queue_only_at_ref_zero() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h(7), [7])
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block not in pool._free_queue
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_queue_block_ids() == [1, 0]
    with pytest.raises(ValueError):
        pool.free_blocks([block])  # double free
    pool.check_integrity()


def test_cached_blocks_are_appended_in_the_order_given() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, h(i), [i])
    pool.free_blocks([blocks[3], blocks[1]])
    pool.free_blocks([blocks[2], blocks[0]])
    assert pool.free_queue_block_ids() == [3, 1, 2, 0]
    pool.check_integrity()


def test_collision_guard_hash_match_with_other_tokens_is_a_miss() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h(1, 2), [1, 2])
    assert pool.get_cached_block(h(1, 2), [1, 2]) is block
    # Forge a collision: another block's tokens arrive under the very same hash.
    assert pool.get_cached_block(h(1, 2), [9, 9]) is None
    assert pool.get_cached_block(h(1, 2), (1, 2)) is block  # tuples and lists compare alike


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(3, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_block(first, h(5), [5])
    assert not pool.cache_block(second, h(5), [5])  # computed the same prefix concurrently
    assert second.block_hash is None and pool.get_cached_block(h(5), [5]) is first
    assert not pool.cache_block(first, h(5), [5])  # re-registering is a no-op
    with pytest.raises(ValueError):
        pool.cache_block(first, h(6), [6])
    pool.free_blocks([second, first])
    assert pool.free_queue_block_ids() == [1, 2, 0]  # the uncached duplicate is reused first
    pool.check_integrity()


def test_cache_block_requires_a_block_in_use() -> None:
    pool = BlockPool(1, enable_caching=True)
    with pytest.raises(ValueError):
        pool.cache_block(pool.blocks[0], h(1), [1])


def test_evict_hook_that_raises_leaves_the_pool_unchanged() -> None:
    def hook(blocks: list[KVBlock]) -> None:
        raise RuntimeError("tier full")

    pool = BlockPool(2, enable_caching=True, on_evict=hook)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h(1), [1])
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 2 and pool.get_cached_block(h(1), [1]) is block
    pool.check_integrity()


def test_caching_disabled_never_caches() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    assert not pool.cache_block(block, h(1), [1])
    assert block.block_hash is None and pool.num_cached_blocks == 0
    assert pool.get_cached_block(h(1), [1]) is None
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    pool.check_integrity()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: setattr(p.blocks[0], "ref_cnt", 1), "in the free queue"),
        (lambda p: p._free_queue.remove(p.blocks[1]), "has ref_cnt 0 but is not free"),
        (lambda p: setattr(p.blocks[2], "block_hash", h(1)), "hash map does not point"),
        (lambda p: p._cached.__setitem__(h(9), p.blocks[3]), "block_hash differs"),
        (lambda p: setattr(p.blocks[1], "_prev", p.blocks[3]), "prev link"),
        (lambda p: setattr(p.blocks[3], "_next", p.blocks[0]), "twice"),
    ],
)
def test_check_integrity_catches_corruption(corrupt: Callable[[BlockPool], object], message: str) -> None:
    pool = BlockPool(4, enable_caching=True)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()
