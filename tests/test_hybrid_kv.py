"""The hybrid KV manager (issue 27), torch-free: stories of a model whose layers form a full-attention
group and sliding-window groups (Gemma 3's layout), each act followed by ``check_integrity`` and, in
the small stories, by a shadow check that every slot a later query can read holds the KV of exactly
the right group and prefix.

A :class:`World` is the scheduler and worker in miniature: it looks up, allocates, runs the step's
swap plan (stores, then loads) and copy-on-write copies on a shadow of the device and host blocks,
"computes" the new slots (the shadow records ``(group, prefix id)`` per slot), caches, and checks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvtier.config import SchedulerConfig
from kvtier.kv.computed import ComputedBlocks
from kvtier.kv.groups import DENSE_LAYOUT, NULL_BLOCK_ID, KVGroupSpec, KVLayout, kv_layout
from kvtier.kv.hashing import group_key, hash_full_blocks, root_hash
from kvtier.kv.manager import KVCacheManager
from kvtier.scheduler.scheduler import Scheduler
from kvtier.stats import Medium
from kvtier.tiers.coordinator import TierCoordinator
from kvtier.tiers.host import HostTier

KEYS = ("fp-hybrid", "")


def gemma_types(num_layers: int) -> tuple[str, ...]:
    """Gemma 3's pattern: layer i is full attention when (i + 1) % 6 == 0, else a sliding window."""
    return tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers))


GEMMA_270M = kv_layout(gemma_types(18), 512)  # used with B = 16
SMALL = kv_layout(gemma_types(6), 40)  # used with B = 8: a window of 5 blocks
SMALL_BS, SMALL_W = 8, 40


# ---------------------------------------------------------------- the world


@dataclass
class Seq:
    tokens: list[int]
    num_computed: int = 0
    prefix_ids: list[int] = field(default_factory=list)  # prefix_ids[p] names tokens[: p + 1]

    def prefix_id(self, p: int) -> int:
        while len(self.prefix_ids) <= p:
            parent = self.prefix_ids[-1] if self.prefix_ids else hash(KEYS)
            self.prefix_ids.append(hash((parent, self.tokens[len(self.prefix_ids)])))
        return self.prefix_ids[p]


class World:
    """A hybrid manager, an optional real host tier, and shadow device and host memory."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, host_blocks: int = 0) -> None:
        self.tiers = TierCoordinator(HostTier(host_blocks)) if host_blocks else None
        self.kv = KVCacheManager(num_blocks, block_size, True, tiers=self.tiers, layout=layout)
        self.layout, self.bs = layout, block_size
        self.seqs: dict[str, Seq] = {}
        self.device: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (group, prefix id)
        self.host: dict[int, dict[int, tuple[int, int]]] = {}  # host block -> offset -> content
        self.deep = True  # the shadow check after every act (off for the 16k-token stories)
        self.last_copies: list[tuple[int, int]] = []  # the last step's copy-on-write copies
        self.last_plan: tuple = ()  # the last step's swap plan: stores, loads and their keys

    # -- acts
    def admit(self, seq_id: str, tokens: list[int], chunk: int | None = None) -> ComputedBlocks:
        """Look the prompt up, adopt the hit and run its first chunk (default: the whole rest)."""
        computed = self.kv.get_computed_blocks(tokens, KEYS)
        n = computed.num_computed_tokens
        num_new = len(tokens) - n if chunk is None else min(chunk, len(tokens) - n)
        assert self.kv.allocate_slots(seq_id, tokens, n, num_new, computed, KEYS)
        self.seqs[seq_id] = Seq(list(tokens), n)
        self.run([(seq_id, num_new)])
        return computed

    def step(self, *work: tuple[str, int]) -> None:
        """One step: allocate every ``(seq, num_new)``, then run them."""
        for seq_id, num_new in work:
            seq = self.seqs[seq_id]
            assert self.kv.allocate_slots(seq_id, seq.tokens, seq.num_computed, num_new), seq_id
        self.run(list(work))

    def decode(self, seq_id: str, token: int) -> None:
        self.seqs[seq_id].tokens.append(token)
        self.step((seq_id, 1))

    def prefill(self, seq_id: str, chunk: int) -> None:
        seq = self.seqs[seq_id]
        while seq.num_computed < len(seq.tokens):
            self.step((seq_id, min(chunk, len(seq.tokens) - seq.num_computed)))

    def fork(self, parent: str, child: str) -> None:
        self.kv.fork(parent, child)
        p = self.seqs[parent]
        self.seqs[child] = Seq(list(p.tokens), p.num_computed, list(p.prefix_ids))
        self.check()

    def free(self, seq_id: str) -> None:
        self.kv.free(seq_id)
        self.check()

    def swap_out(self, seq_id: str) -> bool:
        ok = self.kv.swap_out(seq_id, self.seqs[seq_id].num_computed)
        self.run([])
        return ok

    def swap_in(self, seq_id: str) -> bool:
        seq = self.seqs[seq_id]
        ok = self.kv.swap_in(seq_id, seq.tokens, seq.num_computed, 0)
        self.run([])
        return ok

    # -- the worker
    def run(self, work: list[tuple[str, int]]) -> None:
        """The step's plan (stores, then loads), copy-on-write copies, the forward, caching."""
        plan = self.kv.end_schedule_step()
        self.last_plan = (plan.stores, plan.loads, plan.store_keys, plan.load_keys, plan.discard_keys)
        for device_block, host_block in plan.stores:
            self.host[host_block] = {o: self.device[(device_block, o)] for o in self.offsets(device_block)}
        for host_block, device_block in plan.loads:
            for o in range(self.bs):
                self.device.pop((device_block, o), None)
            self.device.update({(device_block, o): c for o, c in self.host[host_block].items()})
        if self.tiers is not None:
            self.tiers.complete_plan(plan)
        self.last_copies = self.kv.take_block_copies()
        for src, dst in self.last_copies:
            for o in range(self.bs):
                self.device.pop((dst, o), None)
            self.device.update({(dst, o): self.device[(src, o)] for o in self.offsets(src)})
        for seq_id, num_new in work:
            seq, tables = self.seqs[seq_id], self.kv.block_tables(seq_id)
            for p in range(seq.num_computed, seq.num_computed + num_new):
                for g, table in enumerate(tables):
                    self.device[(table[p // self.bs], p % self.bs)] = (g, seq.prefix_id(p))
            seq.num_computed += num_new
            self.kv.cache_blocks(seq_id, seq.tokens, seq.num_computed, KEYS)
        self.check()

    def offsets(self, block: int) -> list[int]:
        return [o for o in range(self.bs) if (block, o) in self.device]

    # -- checks
    def check(self) -> None:
        """Integrity; and every slot the next query of each live sequence can read holds its KV."""
        self.kv.check_integrity()
        if not self.deep:
            return
        self.check_groups()
        for seq_id, seq in self.seqs.items():
            if seq_id not in self.kv._seqs:
                continue
            q = seq.num_computed
            for g, (spec, table) in enumerate(
                zip(self.layout.groups, self.kv.block_tables(seq_id), strict=True)
            ):
                start = 0 if spec.window is None else max(0, q - spec.window + 1)
                for p in range(start, q):
                    block = table[p // self.bs]
                    assert block != NULL_BLOCK_ID, (seq_id, g, p)
                    assert self.device.get((block, p % self.bs)) == (g, seq.prefix_id(p)), (seq_id, g, p)

    def check_groups(self) -> None:
        """Every cached device block, and every host block, is of the KV group whose KV it holds (what
        events announce and what a disk or remote header records)."""
        for block in self.kv.pool.blocks:
            if block.block_hash is not None:
                held = {self.device[(block.block_id, o)][0] for o in self.offsets(block.block_id)}
                assert held <= {block.group}, (block.block_id, block.group, held)
        if self.tiers is not None:
            host = self.tiers.host
            for key in self.tiers.held_keys()[
                Medium.HOST
            ]:  # a swapped-out partial block may hold stale slots
                held = {content[0] for content in self.host.get(host.host_block_of(key), {}).values()}
                assert held <= {host.group_of(key)}, (key.hex()[:12], host.group_of(key), held)

    def held_by_group(self, seq_id: str) -> list[int]:
        return [sum(b != NULL_BLOCK_ID for b in table) for table in self.kv.block_tables(seq_id)]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


# ---------------------------------------------------------------- the layout


def test_gemma3_270m_layout_is_one_full_group_and_five_sliding_groups_of_three_slots() -> None:
    """vLLM's rule: the group size is the smaller kind's layer count (3 full layers), each kind split by
    stride; the full group first, so its keys are the chain itself."""
    layout = GEMMA_270M
    assert layout.layers_per_group == 3 and layout.padded_slots() == ()
    assert [(g.kind, g.window, g.layers) for g in layout.groups] == [
        ("full", None, (5, 11, 17)),
        ("sliding", 512, (0, 6, 12)),
        ("sliding", 512, (1, 7, 13)),
        ("sliding", 512, (2, 8, 14)),
        ("sliding", 512, (3, 9, 15)),
        ("sliding", 512, (4, 10, 16)),
    ]
    assert layout.slot_of(17) == (0, 2) and layout.slot_of(7) == (2, 1)
    assert [(g.kind, g.layers) for g in SMALL.groups] == [("full", (5,))] + [
        ("sliding", (i,)) for i in range(5)
    ]
    # A dense model: one group of every layer, slot = layer.
    dense = kv_layout(("full_attention",) * 4, None)
    assert dense.is_dense and dense.groups == (KVGroupSpec("full", None, (0, 1, 2, 3)),)
    # A kind not a multiple of the group size pads its last group; near-equal kinds use the larger.
    padded = kv_layout(("full_attention",) * 2 + ("sliding_attention",) * 5, 8)
    assert [g.layers for g in padded.groups] == [(0, 1), (2, 5), (3, 6), (4,)] and padded.padded_slots() == (
        (3, 1),
    )
    near = kv_layout(("sliding_attention",) * 12 + ("full_attention",) * 13, 8)
    assert near.layers_per_group == 13 and [len(g.layers) for g in near.groups] == [13, 12]
    with pytest.raises(ValueError, match="unsupported layer type"):
        kv_layout(("linear_attention",), None)


def test_blocks_held_per_group_and_bytes_per_token() -> None:
    """A sliding group holds the blocks its window still reaches: positions ``[n - W + 1, n)``."""
    assert GEMMA_270M.blocks_held_by_group(16384, 16) == (1024, 32, 32, 32, 32, 32)
    assert GEMMA_270M.blocks_held_by_group(100, 16) == (7,) * 6
    # The next query at n sees slots n - 39 .. n (W = 40, B = 8).
    assert SMALL.blocks_held_by_group(41, SMALL_BS) == (6,) * 6  # slot 2: block 0 still reached
    assert SMALL.blocks_held_by_group(48, SMALL_BS) == (6, 5, 5, 5, 5, 5)  # slot 9: block 1 onwards
    assert SMALL.blocks_held_by_group(49, SMALL_BS) == (7, 6, 6, 6, 6, 6)  # slot 10: blocks 1 .. 6
    layer_token_bytes = 2 * 1 * 256 * 2  # K and V, 1 KV head of dim 256, bf16
    assert GEMMA_270M.group_bytes_per_token(layer_token_bytes) == 3 * 1024
    assert GEMMA_270M.block_bytes(16, layer_token_bytes) == 16 * 3 * 1024
    assert GEMMA_270M.kv_bytes_held(16384, 16, layer_token_bytes) == 1184 * 16 * 3 * 1024


def test_group_keys_one_chain_keyed_per_group() -> None:
    chain = hash_full_blocks(list(range(32)), 8, root_hash(KEYS))
    assert all(group_key(h, 0) == h for h in chain)  # group 0 keeps the chain: dense keys unchanged
    keys = {group_key(h, g) for h in chain for g in range(6)}
    assert len(keys) == 6 * len(chain)  # no two groups' blocks collide


# ---------------------------------------------------------------- stories


def test_story_window_release_while_decoding() -> None:
    """A 20-token prompt decodes to 120 tokens. Each sliding group holds the blocks its window can
    reach, never more; the blocks it released stay cached idle (a later prompt can hit them), while
    the full group keeps every block."""
    world = World(SMALL, num_blocks=200, block_size=SMALL_BS)
    world.admit("A", tokens(20, 1))
    released_keys = set()
    for step in range(100):
        world.decode("A", 7 + step)
        n = world.seqs["A"].num_computed
        assert world.held_by_group("A") == list(SMALL.blocks_held_by_group(n, SMALL_BS))
        seq = world.kv._seqs["A"]
        for g in range(1, 6):
            released_keys.update(group_key(seq.block_hashes[i], g) for i in range(seq.num_released[g]))
    assert world.held_by_group("A") == [15, 5, 5, 5, 5, 5]  # 120 tokens: slots 81..119 are in reach
    idle = {b.block_hash for b in world.kv.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None}
    assert len(released_keys) == 5 * 10 and released_keys <= idle
    assert world.kv.num_blocks_in_use_by_group() == (15, 5, 5, 5, 5, 5)


def test_story_second_request_with_the_same_prompt_hits_every_group() -> None:
    """A's prompt (1200 tokens, Gemma 3 270M layout) is computed and freed; B's identical prompt hits
    1184 tokens: the full group's 74 blocks and each sliding group's 32 window blocks, the 42 blocks
    before the window null. Nothing is recomputed but the last 16 tokens."""
    world = World(GEMMA_270M, num_blocks=1000, block_size=16)
    prompt = tokens(1200, 2)
    world.admit("A", prompt, chunk=512)
    world.prefill("A", 512)
    assert world.held_by_group("A") == [75, 32, 32, 32, 32, 32]
    world.free("A")
    computed = world.admit("B", prompt)
    assert computed.num_computed_tokens == 1184 and computed.tokens_by_tier(16)[Medium.DEVICE] == 1184
    assert [(hit.first, hit.num_blocks) for hit in computed.groups] == [(0, 74)] + [(42, 74)] * 5
    tables = world.kv.block_tables("B")  # B computed its last 16 tokens: block 42 left the window too
    assert all(b != NULL_BLOCK_ID for b in tables[0])
    assert all(
        table[:43] == (NULL_BLOCK_ID,) * 43 and NULL_BLOCK_ID not in table[43:] for table in tables[1:]
    )
    assert world.kv.stats.prefix_cache_hits == 1184


def test_story_evicted_sliding_blocks_give_a_shorter_exact_hit() -> None:
    """A (105 tokens) releases its sliding blocks 0-7 as it computes, then is freed. B hits A's first
    48 tokens (touching sliding blocks 1-5 and full 0-5), computes one token and is freed. Pressure then
    evicts: first the released (cold) sliding blocks B did not touch (0, 6, 7), then the oldest cached
    ones, A's last window (blocks 8-12 of every group). A's prompt again: the full group still holds
    blocks 0-7, but the window at 64 tokens needs sliding blocks 3-7; searching from the right, the
    longest hit whose window is cached is 48 tokens (sliding blocks 1-5). The rest is recomputed,
    exactly."""
    world = World(SMALL, num_blocks=123, block_size=SMALL_BS)  # 45 free blocks lead the queue below
    a = tokens(105, 3)
    world.admit("A", a)
    world.free("A")
    assert world.admit("B", a[:48] + tokens(1, 4)).num_computed_tokens == 48
    world.free("B")
    queue = world.kv.pool.free_queue_block_ids()
    evict_until = max(queue.index(world.kv.pool._cached[key].block_id) for key in _window_keys(a, 8, 13))
    # The free blocks, next to go first: 45 free blocks, A's released sliding 0, 6, 7 (15, cold), A's
    # last window 12..8 (30, all groups), then A's full 7 and 6, B's blocks. X takes exactly the first
    # 90: 15 positions.
    assert evict_until + 1 == 90
    world.admit("X", tokens(15 * SMALL_BS, 5))
    kv = world.kv
    full_cached = [
        kv.pool.get_cached_block(h, a[i * 8 : i * 8 + 8]) is not None for i, h in enumerate(_chain(a))
    ]
    assert full_cached[:8] == [True] * 8 and not any(full_cached[8:])
    assert _reference_hit(world, a) == 48
    computed = world.admit("C", a)
    assert computed.num_computed_tokens == 48
    assert [hit.first for hit in computed.groups] == [0] + [1] * 5
    assert world.seqs["C"].num_computed == len(a)  # the rest computed, the shadow check passed


def _chain(token_ids: list[int]) -> list:
    return hash_full_blocks(token_ids, SMALL_BS, root_hash(KEYS))


def _window_keys(token_ids: list[int], start: int, end: int) -> list:
    return [group_key(h, g) for h in _chain(token_ids)[start:end] for g in range(1, 6)]


def _reference_hit(world: World, token_ids: list[int]) -> int:
    """The rule, by brute force: the largest N whose full blocks and sliding windows are all cached."""
    pool, bs = world.kv.pool, SMALL_BS
    chain = _chain(token_ids)
    for n in range((len(token_ids) - 1) // bs, -1, -1):
        needed = [
            (g, i)
            for g, spec in enumerate(SMALL.groups)
            for i in range(spec.first_reachable_block(n * bs, bs), n)
        ]
        if all(
            pool.get_cached_block(group_key(chain[i], g), token_ids[i * bs : (i + 1) * bs]) for g, i in needed
        ):
            return n * bs
    raise AssertionError("unreachable")


def test_story_fork_and_copy_on_write_past_the_window() -> None:
    """n = 2: P (45 tokens: block 5 partial) forks; the first decode of each copies the shared partial
    block in every group (one copy per group for the first writer, none for the second). Both decode
    past the window: each releases its own sliding blocks, the shared ones reach the pool (cached idle)
    once both let go, and the full group shares the prompt's 5 full blocks to the end."""
    world = World(SMALL, num_blocks=300, block_size=SMALL_BS)  # room enough: nothing is evicted
    world.admit("P", tokens(45, 6))
    world.fork("P", "C")
    forked = world.kv.block_tables("P")
    assert forked == world.kv.block_tables("C")
    world.decode("P", 1)
    p_tables, c_tables = world.kv.block_tables("P"), world.kv.block_tables("C")
    assert world.last_copies == [(c[5], p[5]) for p, c in zip(p_tables, c_tables, strict=True)]
    assert all(p[:5] == c[:5] and p[5] != c[5] for p, c in zip(p_tables, c_tables, strict=True))
    world.decode("C", 2)
    assert world.last_copies == [] and world.kv.block_tables("C") == c_tables  # the original is C's alone
    for step in range(60):
        world.seqs["P"].tokens.append(10 + step)
        world.seqs["C"].tokens.append(20 + step)
        world.step(("P", 1), ("C", 1))
    n = world.seqs["P"].num_computed
    assert (
        world.held_by_group("P") == world.held_by_group("C") == list(SMALL.blocks_held_by_group(n, SMALL_BS))
    )
    p_tables, c_tables = world.kv.block_tables("P"), world.kv.block_tables("C")
    assert p_tables[0][:5] == c_tables[0][:5] == forked[0][:5]  # the prompt's full blocks stay shared
    pool = world.kv.pool
    assert all(pool.blocks[b].ref_cnt == 2 for b in forked[0][:5])
    for g in range(1, 6):
        assert not (set(p_tables[g]) & set(c_tables[g])) - {NULL_BLOCK_ID}  # the windows are private now
        assert all(pool.blocks[b].ref_cnt == 0 and pool.blocks[b].block_hash for b in forked[g][:5])
    world.free("P")
    world.free("C")
    assert world.kv.num_free_blocks() == 300


def test_story_preempt_by_recompute_then_the_same_prompt_is_looked_up_again() -> None:
    """A decodes past the window and is preempted by recomputation (freed). Its tokens, looked up
    again, hit every full block and the window's blocks (freed last, so still cached)."""
    world = World(SMALL, num_blocks=100, block_size=SMALL_BS)
    world.admit("A", tokens(30, 7))
    for step in range(50):
        world.decode("A", step)
    a = world.seqs.pop("A")
    world.free("A")
    computed = world.admit("A", a.tokens)
    assert computed.num_computed_tokens == (len(a.tokens) - 1) // SMALL_BS * SMALL_BS == 72
    assert [hit.first for hit in computed.groups] == [0] + [(72 - SMALL_W + 1) // SMALL_BS] * 5
    world.decode("A", 99)


def test_story_preempt_by_swap_with_the_host_tier() -> None:
    """A decodes past the window and is swapped out: the host tier stores every full-group block and
    each sliding group's window blocks only. Swapped back in, its tables have the same shape (null
    where they were null) and every live entry holds the same KV; it decodes on."""
    world = World(SMALL, num_blocks=100, block_size=SMALL_BS, host_blocks=64)
    world.admit("A", tokens(30, 8))
    for step in range(45):
        world.decode("A", step)
    n = world.seqs["A"].num_computed  # 75 tokens
    before = world.kv.block_tables("A")
    content = {
        (g, i): [world.device.get((b, o)) for o in range(SMALL_BS)]
        for g, t in enumerate(before)
        for i, b in enumerate(t)
        if b != NULL_BLOCK_ID
    }
    assert world.swap_out("A") and world.kv.is_swapped("A")
    expected = sum(SMALL.blocks_held_by_group(n, SMALL_BS))
    assert world.tiers is not None and len(world.tiers.host.held_keys()) == expected == 10 + 5 * 6
    assert world.kv.num_free_blocks() == 100
    world.admit("X", tokens(120, 9), chunk=40)  # the device pool is reused meanwhile
    world.prefill("X", 40)
    world.free("X")
    assert world.swap_in("A")
    after = world.kv.block_tables("A")
    assert [[b == NULL_BLOCK_ID for b in t] for t in after] == [
        [b == NULL_BLOCK_ID for b in t] for t in before
    ]
    for (g, i), slots in content.items():
        assert [world.device.get((after[g][i], o)) for o in range(SMALL_BS)] == slots
    world.decode("A", 100)


def test_story_a_returning_prompt_comes_back_from_the_host_tier_in_every_group() -> None:
    """Write-back: A's blocks are evicted from the device into the host tier (every group's under its
    own key); A's prompt again hits the full group's blocks and the sliding windows' blocks from the
    host tier, loaded into fresh device blocks by the step's plan, bytes as computed."""
    world = World(SMALL, num_blocks=80, block_size=SMALL_BS, host_blocks=200)
    a = tokens(70, 10)
    world.admit("A", a)
    world.free("A")
    world.admit("X", tokens(100, 11))  # evicts A's blocks: stored down to the host tier
    world.free("X")
    world.admit("Y", tokens(100, 12))
    world.free("Y")
    computed = world.admit("A2", a)
    assert computed.num_computed_tokens == 64
    assert computed.tokens_by_tier(SMALL_BS)[Medium.HOST] == 64  # X and Y evicted every block of A's
    loaded = [sum(src == Medium.HOST for src in hit.sources) for hit in computed.groups]
    assert loaded == [8, 5, 5, 5, 5, 5]  # the full group's 8 blocks and each sliding window's 5


def test_story_blocks_out_of_the_window_never_push_a_returning_prompt_out_of_the_host_tier() -> None:
    """X, Y and Z prefill 100 tokens each in 8-token chunks: their sliding groups release ~40 blocks each
    out of the window while they run. Those are *cold*: first in line for eviction on the device, and
    kept by the host tier only in free room. So the 100-block host tier, which cannot hold every block
    the device evicts (A's 53, 77 of each other's), still holds A's: A's prompt hits whole. (Without
    the rule, the released blocks pushed every block of A's out: a hit of 0.)"""
    world = World(SMALL, num_blocks=80, block_size=SMALL_BS, host_blocks=100)
    a = tokens(70, 10)
    world.admit("A", a)
    world.free("A")
    for name, seed in (("X", 11), ("Y", 12), ("Z", 13)):
        world.admit(name, tokens(100, seed), chunk=SMALL_BS)
        world.prefill(name, SMALL_BS)
        world.free(name)
    computed = world.admit("A2", a)
    assert computed.num_computed_tokens == 64
    assert computed.tokens_by_tier(SMALL_BS)[Medium.HOST] == 64
    assert world.tiers is not None and world.tiers.host.counters.blocks_evicted > 0  # the host was full


# ---------------------------------------------------------------- random schedules

DOCS = (tuple(range(1, 60)), tuple(range(1, 20)) + (7,) * 40, (3,) * 60)
TINY = kv_layout(("full_attention",) * 2 + ("sliding_attention",) * 5, 5)  # 4 groups, one padded slot


@pytest.mark.parametrize(("layout", "block_size"), [(SMALL, SMALL_BS), (TINY, 4)])
@pytest.mark.parametrize("seed", range(12))
def test_random_schedules_keep_every_group_exact(layout: KVLayout, block_size: int, seed: int) -> None:
    """Prompts cut from a few documents (prefixes collide), chunked prefills, decodes, forks, frees,
    swaps through a small host tier, on a pool small enough to refuse and evict: after every act the
    books balance and every slot a next query can read holds its group's KV of the right prefix."""
    rng = random.Random(seed)
    world = World(layout, num_blocks=60, block_size=block_size, host_blocks=24)
    swapped: list[str] = []
    for act in range(150):
        live = sorted(s for s in world.seqs if s in world.kv._seqs)
        kind = rng.choice(
            ["admit", "admit", "step", "step", "step", "step", "fork", "free", "swap", "resume"]
        )
        if kind == "admit" or (not live and kind != "resume"):
            prompt = list(rng.choice(DOCS)[: rng.randrange(1, 60)]) + [
                rng.randrange(5) for _ in range(rng.randrange(3))
            ]
            computed = world.kv.get_computed_blocks(prompt, KEYS)
            n = computed.num_computed_tokens
            num_new = min(rng.randrange(1, 24), len(prompt) - n)
            if world.kv.allocate_slots(f"s{act}", prompt, n, num_new, computed, KEYS):
                world.seqs[f"s{act}"] = Seq(prompt, n)
                world.run([(f"s{act}", num_new)])
        elif kind == "resume" and swapped:
            if world.swap_in(swapped[0]):
                swapped.pop(0)
        elif kind in ("step", "fork", "free", "swap") and live:
            random_step(world, rng, kind, rng.choice(live), swapped, act)
        world.check()
    for seq_id in [*world.seqs]:
        world.kv.free(seq_id)
    world.kv.check_integrity()
    assert world.kv.num_free_blocks() == 60


def random_step(
    world: World, rng: random.Random, kind: str, seq_id: str, swapped: list[str], act: int
) -> None:
    seq = world.seqs[seq_id]
    if kind == "step":
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(rng.randrange(5))
        num_new = min(rng.randrange(1, 24), len(seq.tokens) - seq.num_computed)
        if world.kv.allocate_slots(seq_id, seq.tokens, seq.num_computed, num_new):
            world.run([(seq_id, num_new)])
    elif kind == "fork" and len(world.kv._seqs) < 6:
        world.fork(seq_id, f"f{act}")
    elif kind == "free":
        world.free(seq_id)
        del world.seqs[seq_id]
    elif kind == "swap" and world.swap_out(seq_id):
        swapped.append(seq_id)


# ---------------------------------------------------------------- the memory bound


def conversation(layout: KVLayout, num_blocks: int, turns: int = 16) -> tuple[World, int]:
    """A 16k-token chat: each turn is a new request whose prompt is the whole history plus ~1000 new
    tokens (a prefix hit, then 512-token prefill chunks) and 24 decoded tokens."""
    world = World(layout, num_blocks, 16)
    world.deep = False
    history: list[int] = []
    for turn in range(turns):
        prompt = history + tokens(1024 - 24, 100 + turn)
        seq_id = f"turn{turn}"
        world.admit(seq_id, prompt, chunk=512)
        world.prefill(seq_id, 512)
        for i in range(24):
            world.decode(seq_id, 1000 + i)
        history = world.seqs[seq_id].tokens
        if turn < turns - 1:
            world.free(seq_id)
    return world, world.kv.num_held_blocks(f"turn{turns - 1}")


def test_a_16k_token_conversation_holds_a_fifth_of_the_kv_of_all_full_layers() -> None:
    hybrid, held = conversation(GEMMA_270M, num_blocks=4000)
    dense_layout = kv_layout(("full_attention",) * 18, None)
    dense, dense_held = conversation(dense_layout, num_blocks=1200)
    assert hybrid.seqs["turn15"].num_computed == 16384
    assert held == 1024 + 5 * 32 and dense_held == 1024
    ratio = held * GEMMA_270M.layers_per_group / (dense_held * dense_layout.layers_per_group)
    print(
        f"16k-token conversation: hybrid {held} blocks x 3 slots vs all-full {dense_held} x 18: {ratio:.3f}x"
    )
    assert ratio <= 0.25


def test_the_pool_fits_four_times_as_many_8k_sequences() -> None:
    """The same bytes of pool: 9600 blocks of 3 slots (hybrid) or 1600 blocks of 18 (all full). Each
    8k-token prompt is prefilled in 512-token chunks; count the sequences that fit."""

    def fits(layout: KVLayout, num_blocks: int) -> int:
        world = World(layout, num_blocks, 16)
        world.deep = False
        for i in range(100):
            prompt = tokens(8192, 200 + i)
            computed = world.kv.get_computed_blocks(prompt, KEYS)
            if not world.kv.allocate_slots(f"s{i}", prompt, 0, 512, computed, KEYS):
                return i
            world.seqs[f"s{i}"] = Seq(prompt)
            world.run([(f"s{i}", 512)])
            while world.seqs[f"s{i}"].num_computed < 8192:
                seq = world.seqs[f"s{i}"]
                if not world.kv.allocate_slots(f"s{i}", seq.tokens, seq.num_computed, 512):
                    return i
                world.run([(f"s{i}", 512)])
        raise AssertionError("the pool never filled")

    hybrid = fits(GEMMA_270M, 9600)
    dense = fits(kv_layout(("full_attention",) * 18, None), 1600)
    print(f"8k-token sequences in one pool: hybrid {hybrid}, all full {dense}: {hybrid / dense:.2f}x")
    assert dense == 3 and hybrid >= 4 * dense


def test_the_schedulers_kv_estimates_count_blocks_over_every_group() -> None:
    kv = KVCacheManager(4000, 16, True, layout=GEMMA_270M)
    scheduler = Scheduler(SchedulerConfig(max_model_len=32768), kv, eos_token_ids=[0])
    prompt = tokens(8192, 13)
    need = scheduler.kv_need_for(prompt, KEYS, max_tokens=8192, max_model_len=32768)
    assert need == GEMMA_270M.num_blocks_held(16384, 16) == 1184
    dense = KVCacheManager(4000, 16, True)
    assert (
        Scheduler(SchedulerConfig(max_model_len=32768), dense, [0]).kv_need_for(prompt, KEYS, 8192, 32768)
        == 1024
    )


# ---------------------------------------------------------------- one group is today's manager


def test_one_group_layout_pins_the_existing_story_values() -> None:
    """tests/test_kv_manager.py's first story, through a manager built with a one-group layout: the
    same block ids, free queue, hashes and counters."""
    evicted: list = []
    kv = KVCacheManager(
        8,
        4,
        True,
        on_evict=lambda b: evicted.append((b.block_id, b.block_hash)),
        layout=kv_layout(("full_attention",) * 30, None),
    )
    a = list(range(100, 114))
    computed = kv.get_computed_blocks(a, KEYS)
    assert kv.allocate_slots("A", a, 0, len(a), computed, KEYS)
    kv.cache_blocks("A", a, len(a), KEYS)
    a_hashes = hash_full_blocks(a, 4, root_hash(KEYS))
    assert kv.block_ids("A") == [0, 1, 2, 3] and [h for _, h in kv.cached_blocks()] == a_hashes
    kv.free("A")
    assert kv.pool.free_queue_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    b = a[:8] + [7] * 6
    computed = kv.get_computed_blocks(b, KEYS)
    assert computed.block_ids == (0, 1) and computed.groups == ()
    assert kv.allocate_slots("B", b, 8, len(b) - 8, computed, KEYS)
    assert kv.block_ids("B") == [0, 1, 3, 4] and kv.block_tables("B") == ((0, 1, 3, 4),)
    c = list(range(200, 215))
    assert kv.allocate_slots("C", c, 0, len(c), kv.get_computed_blocks(c, KEYS), KEYS)
    assert kv.block_ids("C") == [5, 6, 7, 2] and evicted == [(2, a_hashes[2])]
    kv.check_integrity()


def test_one_group_layout_and_the_default_manager_agree_step_by_step() -> None:
    """A scripted schedule (prefix hits, decode, fork, copy-on-write, swap through a real host tier,
    free) through a default manager and one built with ``kv_layout(all full)``: the same tables, free
    queue, hash map and plans after every act."""
    worlds = [
        World(layout, 12, 4, host_blocks=8)
        for layout in (DENSE_LAYOUT, kv_layout(("full_attention",) * 2, None))
    ]
    rng = random.Random(0)
    for act in range(200):
        seed = rng.random()
        states = []
        for world in worlds:
            random_act(world, random.Random(seed), act)
            kv = world.kv
            states.append(
                (
                    {s: kv.block_ids(s) for s in kv._seqs},
                    kv.pool.free_queue_block_ids(),
                    sorted((h, b.block_id) for h, b in kv.pool._cached.items()),
                    sorted(world.tiers.host.held_keys()),
                    world.last_plan,
                    kv.stats,
                )
            )
        assert states[0] == states[1], act


def random_act(world: World, rng: random.Random, act: int) -> None:
    kv = world.kv
    live = [s for s in world.seqs if s in kv._seqs]
    choice = rng.choice(["admit", "decode", "decode", "fork", "free", "swap"])
    if choice == "admit" or not live:
        prompt = list(range(1, 30))[: rng.randrange(2, 28)] + [rng.randrange(3)]
        seq_id = f"s{act}"
        computed = kv.get_computed_blocks(prompt, KEYS)
        n = computed.num_computed_tokens
        if kv.allocate_slots(seq_id, prompt, n, len(prompt) - n, computed, KEYS):
            world.seqs[seq_id] = Seq(prompt, n)
            world.run([(seq_id, len(prompt) - n)])
        return
    seq_id = rng.choice(sorted(live))
    seq = world.seqs[seq_id]
    if choice == "decode":
        seq.tokens.append(rng.randrange(3))
        if kv.allocate_slots(seq_id, seq.tokens, seq.num_computed, 1):
            world.run([(seq_id, 1)])
        else:
            seq.tokens.pop()
    elif choice == "fork" and len(live) < 4:
        world.fork(seq_id, f"f{act}")
    elif choice == "free" or (choice == "swap" and world.swap_out(seq_id) and not world.swap_in(seq_id)):
        world.free(seq_id)  # freed, or swapped out and not resumed (aborted while swapped)
        del world.seqs[seq_id]
