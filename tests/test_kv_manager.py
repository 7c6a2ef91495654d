"""KVCacheManager: stories of prefix reuse, eviction, fork and copy-on-write, plus a property test
that drives random schedules against a tiny pool and checks that no block ever has two writers
and that every computed slot holds the KV of the right prefix."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvtier.kv.hashing as hashing
from kvtier.kv.block_pool import KVBlock
from kvtier.kv.hashing import BlockHash, hash_full_blocks, root_hash
from kvtier.kv.manager import ComputedBlocks, KVCacheManager

BS = 4
KEYS = ("fp-test", "")


def new_manager(num_blocks: int = 8, enable_caching: bool = True, **kwargs: Any) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching, **kwargs)


def prefill(kv: KVCacheManager, seq_id: str, tokens: list[int], keys: tuple = KEYS) -> ComputedBlocks:
    """Look up, allocate the whole rest of the prompt, 'run' it and cache: one prefill step."""
    computed = kv.get_computed_blocks(tokens, keys)
    n = computed.num_computed_tokens
    assert kv.allocate_slots(seq_id, tokens, n, len(tokens) - n, computed, keys)
    kv.cache_blocks(seq_id, tokens, len(tokens), keys)
    return computed


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return (
        {seq_id: kv.block_ids(seq_id) for seq_id in kv._seqs},
        [b.ref_cnt for b in pool.blocks],
        pool.free_queue_block_ids(),
        sorted((h, b.block_id) for h, b in pool._cached.items()),
        list(kv._pending_copies),
    )


# ---------------------------------------------------------------- stories


def test_story_reuse_touch_then_evict_lru() -> None:
    """A (2 full blocks + ...) is cached and freed; B shares A's first 8 tokens and hits 2 blocks,
    touched out of the middle of the free queue; C needs more than the uncached free blocks, so
    A's third block (least recently used cached idle) is evicted and on_evict sees its hash."""
    evicted: list[tuple[int, BlockHash | None]] = []
    kv = new_manager(8, on_evict=lambda b: evicted.append((b.block_id, b.block_hash)))
    a = list(range(100, 114))  # 14 tokens: 3 full blocks + 2 slots
    assert prefill(kv, "A", a).block_ids == ()
    assert kv.block_ids("A") == [0, 1, 2, 3] and kv.pool.num_cached_blocks == 3
    a_hashes = hash_full_blocks(a, BS, root_hash(KEYS))
    kv.free("A")
    # Partial block 3 first (worthless), then free blocks, then A's blocks tail first.
    assert kv.pool.free_queue_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    kv.check_integrity()

    b = a[:8] + [7, 7, 7, 7, 7, 7]
    computed = kv.get_computed_blocks(b, KEYS)
    assert computed.block_ids == (0, 1) and computed.num_computed_tokens == 8
    assert kv.pool.blocks[0].ref_cnt == 0  # a lookup takes no reference
    assert kv.allocate_slots("B", b, 8, len(b) - 8, computed, KEYS)
    assert kv.block_ids("B") == [0, 1, 3, 4]
    assert kv.pool.free_queue_block_ids() == [5, 6, 7, 2]
    kv.check_integrity()

    c = list(range(200, 215))
    assert kv.allocate_slots("C", c, 0, len(c), kv.get_computed_blocks(c, KEYS), KEYS)
    assert kv.block_ids("C") == [5, 6, 7, 2]
    assert evicted == [(2, a_hashes[2])] and kv.device_counters.blocks_evicted == 1
    assert kv.num_free_blocks() == 0 and kv.usage() == 1.0
    assert kv.stats.prefix_cache_queries == len(a) + len(b) + len(c)
    assert kv.stats.prefix_cache_hits == 8
    kv.check_integrity()


def test_free_releases_tail_first_so_the_prefix_survives_longest() -> None:
    evicted: list[int] = []
    kv = new_manager(4, on_evict=lambda b: evicted.append(b.block_id))
    a = list(range(17))  # 4 full blocks + 1 token; cache the 4 full ones
    assert kv.allocate_slots("A", a, 0, 16)
    kv.cache_blocks("A", a, 16)
    kv.free("A")
    assert kv.pool.free_queue_block_ids() == [3, 2, 1, 0]
    assert kv.allocate_slots("X", [9], 0, 1)
    assert evicted == [3]
    assert kv.get_computed_blocks(a, ()).block_ids == (0, 1, 2)  # prefix still there
    kv.check_integrity()


def test_collision_guard_same_hash_other_tokens_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force every block at the same chain position to collide: lookups must still miss."""
    real = hashing._BLOCK_HASHER

    class Blind:  # a block's hash of its parent and token count, not of its tokens
        def __init__(self) -> None:
            self.h, self.parts = real.copy(), 0

        def update(self, data: bytes) -> None:
            self.parts += 1
            if self.parts < 3:  # the parent, the count; the tokens come third
                self.h.update(data)

        def digest(self) -> bytes:
            return self.h.digest()

    class Colliding:
        def copy(self) -> Blind:
            return Blind()

    monkeypatch.setattr(hashing, "_BLOCK_HASHER", Colliding())  # every chain the manager hashes starts here
    kv = new_manager(8)
    prefill(kv, "A", [1, 2, 3, 4, 5])
    other = [9, 9, 9, 9, 5]
    assert kv.get_computed_blocks(other, KEYS).block_ids == ()
    prefill(kv, "B", other)  # its block hashes the same: stays an uncached duplicate
    assert kv.pool.num_cached_blocks == 1 and kv.pool.blocks[kv.block_ids("B")[0]].block_hash is None
    assert kv.get_computed_blocks([1, 2, 3, 4, 0], KEYS).block_ids == (0,)
    kv.check_integrity()


def test_cache_salt_isolates_tenants() -> None:
    kv = new_manager(8)
    prompt = list(range(9))
    prefill(kv, "A", prompt, ("fp", "tenant-a"))
    kv.free("A")
    assert kv.get_computed_blocks(prompt, ("fp", "tenant-b")).block_ids == ()
    assert kv.get_computed_blocks(prompt, ("other-model", "tenant-a")).block_ids == ()
    assert kv.get_computed_blocks(prompt, ("fp", "tenant-a")).block_ids == (0, 1)
    kv.check_integrity()


def test_last_token_is_always_computed() -> None:
    kv = new_manager(8)
    prompt = list(range(2 * BS))
    assert kv.allocate_slots("A", prompt, 0, len(prompt))
    kv.cache_blocks("A", prompt, len(prompt))
    assert kv.pool.num_cached_blocks == 2  # both blocks are cached ...
    computed = kv.get_computed_blocks(prompt, ())
    assert computed.block_ids == (0,) and computed.num_computed_tokens == BS  # ... but only 1 hits
    assert kv.get_computed_blocks([*prompt, 99], ()).num_computed_tokens == 2 * BS
    assert kv.get_computed_blocks([], ()).block_ids == ()
    kv.check_integrity()


def test_failed_allocation_changes_nothing() -> None:
    """B's hit blocks are idle in the free queue: taking them counts against the free blocks."""
    kv = new_manager(4)
    a = list(range(9))
    prefill(kv, "A", a)  # blocks 0, 1 cached; 2 holds the 9th token
    kv.free("A")
    b = a[:8] + list(range(50, 59))  # 17 tokens: 2 hits + 3 new blocks = 5 > 4
    computed = kv.get_computed_blocks(b, KEYS)
    assert computed.block_ids == (0, 1)
    before = snapshot(kv)
    assert not kv.allocate_slots("B", b, 8, len(b) - 8, computed, KEYS)
    assert snapshot(kv) == before and "B" not in kv
    # An existing sequence whose growth does not fit is left alone too.
    assert kv.allocate_slots("B", b, 8, 4, computed, KEYS)
    before = snapshot(kv)
    assert not kv.allocate_slots("B", b, 12, 5)
    assert snapshot(kv) == before
    kv.check_integrity()


def test_fork_then_copy_on_write_of_the_shared_partial_block() -> None:
    kv = new_manager(8)
    prompt = [1, 2, 3, 4, 5, 6]  # block 0 full, block 1 holds 2 of 4 slots
    prefill(kv, "P", prompt)
    kv.fork("P", "C")
    assert kv.block_ids("C") == kv.block_ids("P") == [0, 1]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    kv.check_integrity()

    parent_tokens, child_tokens = [*prompt, 10], [*prompt, 20]
    assert kv.allocate_slots("P", parent_tokens, 6, 1)  # slot 6 is in shared block 1: copy it
    assert kv.block_ids("P") == [0, 2]
    assert kv.take_block_copies() == [(1, 2)]
    assert kv.take_block_copies() == []
    assert kv.allocate_slots("C", child_tokens, 6, 1)  # block 1 is the child's alone now
    assert kv.block_ids("C") == [0, 1] and kv.take_block_copies() == []
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    kv.check_integrity()

    kv.cache_blocks("P", parent_tokens, 7)
    kv.cache_blocks("C", child_tokens, 7)
    kv.free("P")
    kv.free("C")
    assert kv.num_free_blocks() == 8
    kv.check_integrity()


def test_the_runners_block_ids_follow_every_table_change() -> None:
    """The ids the runner reads each step are kept, not rebuilt: extended as a table grows, rebuilt after
    an entry changes in place (here a copy-on-write). A change that skipped ``touch`` is caught."""
    kv = new_manager(8)
    prompt = [1, 2, 3, 4, 5, 6]
    prefill(kv, "P", prompt)
    assert kv.block_tables("P") == ((0, 1),)
    kv.fork("P", "C")
    assert kv.allocate_slots("P", [*prompt, 7], 6, 1)  # copy-on-write of block 1, in place
    assert kv.block_tables("P") == ((0, 2),) and kv.block_tables("C") == ((0, 1),)
    tokens = [*prompt, 7, 8, 9]
    assert kv.allocate_slots("P", tokens, 7, 2)  # the table grows past its end: block 3
    assert kv.block_tables("P") == ((0, 2, 3),)
    kv.check_integrity()

    before = [b.ref_cnt for b in kv.pool.blocks]
    assert kv.allocate_slots("P", tokens, 8, 1)  # a decode token in a block of its own: nothing to do
    assert [b.ref_cnt for b in kv.pool.blocks] == before and kv.block_tables("P") == ((0, 2, 3),)

    seq = kv._seqs["P"]
    seq.tables[0][2], seq.tables[0][1] = seq.tables[0][1], seq.tables[0][2]  # no touch: the ids are stale
    with pytest.raises(AssertionError, match="stale block ids"):
        kv.check_integrity()
    seq.touch()
    assert kv.block_tables("P") == ((0, 3, 2),)


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    kv = new_manager(8)
    prompt = list(range(8))
    prefill(kv, "P", prompt)
    kv.fork("P", "C")
    assert kv.allocate_slots("P", [*prompt, 1], 8, 1)
    assert kv.allocate_slots("C", [*prompt, 2], 8, 1)
    assert kv.take_block_copies() == []
    assert kv.block_ids("P")[:2] == kv.block_ids("C")[:2] and kv.block_ids("P")[2] != kv.block_ids("C")[2]
    with pytest.raises(ValueError):
        kv.fork("P", "C")
    kv.check_integrity()


def test_preempted_sequence_recomputes_from_its_own_cached_blocks() -> None:
    kv = new_manager(8)
    tokens = list(range(6))
    prefill(kv, "A", tokens)
    for step in range(5):  # decode 5 tokens, caching as blocks fill
        tokens.append(100 + step)
        assert kv.allocate_slots("A", tokens, len(tokens) - 1, 1)
        kv.cache_blocks("A", tokens, len(tokens))
    table = kv.block_ids("A")
    kv.free("A")  # preempted by recomputation
    computed = kv.get_computed_blocks(tokens, KEYS)  # 11 tokens: 2 full blocks come back
    assert computed.block_ids == tuple(table[:2])
    assert kv.allocate_slots("A", tokens, 8, 3, computed, KEYS)
    assert kv.block_ids("A")[:2] == table[:2]
    kv.check_integrity()


def test_incremental_hashing_never_rehashes_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_hashing import count_hashes

    calls = count_hashes(monkeypatch)
    kv = new_manager(16)
    tokens = [1]
    assert kv.allocate_slots("A", tokens, 0, 1)
    for step in range(40):
        kv.cache_blocks("A", tokens, len(tokens))
        tokens.append(step)
        assert kv.allocate_slots("A", tokens, len(tokens) - 1, 1)
    kv.cache_blocks("A", tokens, len(tokens))
    assert calls[0] == len(tokens) // BS == kv.pool.num_cached_blocks
    kv.check_integrity()


def test_stale_lookup_is_rejected() -> None:
    kv = new_manager(2)
    prefill(kv, "A", [1, 2, 3, 4, 5])
    kv.free("A")
    computed = kv.get_computed_blocks([1, 2, 3, 4, 5], KEYS)
    assert kv.allocate_slots("X", [7, 7, 7, 7, 7, 7], 0, 6)  # evicts the hit block
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_slots("B", [1, 2, 3, 4, 5], 4, 1, computed, KEYS)
    kv.check_integrity()


def test_concurrent_identical_prompts_leave_one_cached_copy() -> None:
    kv = new_manager(8)
    prompt = list(range(9))
    for seq_id in ("A", "B"):  # both looked up before either cached
        assert kv.allocate_slots(seq_id, prompt, 0, len(prompt))
    for seq_id in ("A", "B"):
        kv.cache_blocks(seq_id, prompt, len(prompt))
    assert kv.pool.num_cached_blocks == 2
    kv.free("B")
    kv.free("A")
    # Uncached blocks (B's duplicates, A's partial tail) are reused before A's cached ones.
    assert kv.pool.free_queue_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    kv.check_integrity()


def test_caching_disabled() -> None:
    kv = new_manager(4, enable_caching=False)
    prompt = list(range(9))
    assert prefill(kv, "A", prompt).block_ids == ()
    assert kv.pool.num_cached_blocks == 0
    kv.free("A")
    assert kv.get_computed_blocks(prompt, KEYS).block_ids == ()
    assert kv.stats.prefix_cache_queries == 0
    prefill(kv, "B", prompt)
    kv.check_integrity()


def test_argument_errors() -> None:
    kv = new_manager(4)
    with pytest.raises(ValueError):
        kv.allocate_slots("A", [1, 2], 0, 3)  # more slots than tokens
    with pytest.raises(ValueError):
        kv.allocate_slots("A", [1, 2], 1, 1)  # claims computed tokens without blocks
    with pytest.raises(KeyError):
        kv.block_ids("A")
    with pytest.raises(KeyError):
        kv.cache_blocks("A", [1], 1)
    kv.free("never-allocated")  # no-op
    assert kv.allocate_slots("A", [1, 2], 0, 1)
    with pytest.raises(ValueError):
        kv.allocate_slots("A", [1, 2, 3, 4, 5, 6], 5, 1)  # table covers 4 slots, not 5
    with pytest.raises(ValueError):
        kv.cache_blocks("A", [1, 2], 1, ("another-model",))
    with pytest.raises(ValueError):
        KVCacheManager(4, 0, True)
    kv.check_integrity()


# ---------------------------------------------------------------- property test

SALTS = ("a", "b")
# Prompts are a cut of one of a few "documents" plus a short random tail, so prefixes collide a lot.
DOCUMENTS = ((0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 0, 2, 2, 2, 2, 1, 0), (1,) * 12)
# An operation is one int (fast to generate and to shrink), decoded by ``decode`` into
# (kind, a, b, c): kind indexes KINDS, whose repeats weight the draw.
KINDS = ("add", "add", "step", "step", "step", "step", "fork", "free", "preempt", "preempt", "resume")
op = st.integers(0, len(KINDS) * 16 * 16 * 64 - 1)


def decode(operation: int) -> tuple[str, int, int, int]:
    rest, kind = divmod(operation, len(KINDS))
    rest, a = divmod(rest, 16)
    c, b = divmod(rest, 16)
    return KINDS[kind], a, b, c


class Harness:
    """The scheduler and worker in miniature, with a shadow KV: slot -> (salt, prefix it encodes).

    A live sequence has ``num_computed`` slots whose KV is written and ``pending`` slots allocated
    and about to be written; "step" writes the pending slots (the forward pass), caches, samples a
    token when the prompt is done, and schedules the next chunk.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching)
        self.bs = block_size
        self.live: dict[str, dict[str, Any]] = {}  # seq_id -> tokens, salt, num_computed, pending
        self.waiting: list[tuple[list[int], str]] = []
        self.shadow: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}
        self.next_id = 0

    def pick(self, index: int) -> str | None:
        ids = sorted(self.live)
        return ids[index % len(ids)] if ids else None

    def apply_copies(self) -> None:  # the worker copies blocks before the step writes any KV
        for src, dst in self.kv.take_block_copies():
            event("copy-on-write")
            for offset in range(self.bs):
                if (src, offset) in self.shadow:
                    self.shadow[(dst, offset)] = self.shadow[(src, offset)]
                else:
                    self.shadow.pop((dst, offset), None)

    def admit(self, tokens: list[int], salt: str) -> bool:
        if len(self.live) >= 5:
            return False
        keys = ("fp", salt)
        computed = self.kv.get_computed_blocks(tokens, keys)
        seq_id = f"s{self.next_id}"
        before, before_free = snapshot(self.kv), self.kv.num_free_blocks()
        n = computed.num_computed_tokens
        if n:
            event("prefix hit")
        hits = [self.kv.pool.blocks[i] for i in computed.block_ids]
        needed = sum(b.ref_cnt == 0 for b in hits) + -(-len(tokens) // self.bs) - len(hits)
        ok = self.kv.allocate_slots(seq_id, tokens, n, len(tokens) - n, computed, keys)
        assert ok == (needed <= before_free), "refused although the pool had room, or the reverse"
        if not ok:
            event("admission refused")
            assert snapshot(self.kv) == before
            return False
        self.next_id += 1
        self.live[seq_id] = {"tokens": tokens, "salt": salt, "num_computed": n, "pending": len(tokens) - n}
        self.apply_copies()
        return True

    def complete(self, seq_id: str, sampled: int) -> None:
        """The forward pass writes the pending slots; full blocks get cached; maybe sample a token."""
        seq = self.live[seq_id]
        if seq["pending"] == 0:
            return
        table = self.kv.block_ids(seq_id)
        start = seq["num_computed"]
        for slot in range(start, start + seq["pending"]):
            self.shadow[(table[slot // self.bs], slot % self.bs)] = (
                seq["salt"],
                tuple(seq["tokens"][: slot + 1]),
            )
        seq["num_computed"] += seq["pending"]
        seq["pending"] = 0
        self.kv.cache_blocks(seq_id, seq["tokens"], seq["num_computed"], ("fp", seq["salt"]))
        if seq["num_computed"] == len(seq["tokens"]):
            seq["tokens"] = [*seq["tokens"], sampled]

    def schedule(self, seq_id: str, chunk: int) -> None:
        seq = self.live[seq_id]
        n = min(chunk, len(seq["tokens"]) - seq["num_computed"])
        before, before_free, table = snapshot(self.kv), self.kv.num_free_blocks(), self.kv.block_ids(seq_id)
        start, end = seq["num_computed"], seq["num_computed"] + n
        shared = [i for i in range(start // self.bs, min(-(-end // self.bs), len(table))) if n]
        num_copies = sum(self.kv.pool.blocks[table[i]].ref_cnt > 1 for i in shared)
        needed = max(0, -(-end // self.bs) - len(table)) + num_copies
        ok = self.kv.allocate_slots(seq_id, seq["tokens"], seq["num_computed"], n)
        assert ok == (needed <= before_free), "refused although the pool had room, or the reverse"
        if ok:
            seq["pending"] = n
            self.apply_copies()
        else:
            event("growth refused")
            assert snapshot(self.kv) == before

    def run(self, operation: int) -> None:
        kind, a, b, c = decode(operation)
        if kind == "add":  # a cut of a document plus a tail of up to 3 tokens (base-3 digits of c)
            tail = [(c // 4) // 3**i % 3 for i in range(c % 4)]
            self.admit([*DOCUMENTS[a % 3][: b % 13], *tail] or [0], SALTS[a // 3 % 2])
            return
        if kind == "resume":
            if self.waiting and self.admit(*self.waiting[0]):
                self.waiting.pop(0)
            return
        seq_id = self.pick(a)
        if seq_id is None:
            return
        sampled = c % 3
        if kind == "step":
            self.complete(seq_id, sampled)
            self.schedule(seq_id, chunk=1 + b % 6)
        elif kind == "fork" and len(self.live) < 5:  # n > 1 sampling: fork once the step is done
            self.complete(seq_id, sampled)
            child = f"s{self.next_id}"
            self.next_id += 1
            self.kv.fork(seq_id, child)
            self.live[child] = {**self.live[seq_id], "tokens": list(self.live[seq_id]["tokens"])}
        elif kind in ("free", "preempt"):
            seq = self.live.pop(seq_id)
            self.kv.free(seq_id)
            if kind == "preempt":
                self.waiting.append((seq["tokens"], seq["salt"]))

    def check(self) -> None:
        self.kv.check_integrity()
        tables = {seq_id: self.kv.block_ids(seq_id) for seq_id in self.live}
        assert set(self.kv._seqs) == set(self.live)
        for seq_id, seq in self.live.items():
            table, bs = tables[seq_id], self.bs
            start, end = seq["num_computed"], seq["num_computed"] + seq["pending"]
            assert len(table) * bs >= end
            # Every computed slot holds the KV of exactly this sequence's prefix (reuse is correct).
            for slot in range(start):
                expected = (seq["salt"], tuple(seq["tokens"][: slot + 1]))
                assert self.shadow.get((table[slot // bs], slot % bs)) == expected, (seq_id, slot)
            # Blocks about to be written have one writer: this sequence, alone, uncached.
            others = {b for other, t in tables.items() if other != seq_id for b in t}
            for index in range(start // bs, -(-end // bs) if end > start else 0):
                block: KVBlock = self.kv.pool.blocks[table[index]]
                assert block.ref_cnt == 1, (seq_id, block)
                assert block.block_hash is None, (seq_id, block)
                assert block.block_id not in others, (seq_id, block)


@settings(max_examples=200, deadline=None)
@given(
    operations=st.lists(op, min_size=20, max_size=60),
    num_blocks=st.integers(3, 12),
    block_size=st.sampled_from([1, 2, 4]),
    enable_caching=st.booleans(),
)
def test_random_schedules_keep_the_cache_consistent(
    operations: list[int], num_blocks: int, block_size: int, enable_caching: bool
) -> None:
    harness = Harness(num_blocks, block_size, enable_caching)
    for operation in operations:
        harness.run(operation)
        harness.check()
    if harness.kv.device_counters.blocks_evicted:
        event("eviction")
    for seq_id in list(harness.live):
        harness.kv.free(seq_id)
    harness.kv.check_integrity()
    assert harness.kv.num_free_blocks() == num_blocks and harness.kv.usage() == 0.0
