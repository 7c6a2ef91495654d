"""The router's hybrid prefix rule is the engine's: on random layouts and random sets of cached group
blocks, ``kvtier.router.groups.hybrid_prefix`` finds exactly the hit ``find_group_hit`` (the engine's
lookup, ``kvtier/kv/group_lookup.py``) finds in a real block pool holding those blocks. And the layout
the router reads is the one ``/v1/kv/info`` reports."""

from __future__ import annotations

import random

import pytest

from kvtier.kv.block_pool import BlockPool
from kvtier.kv.group_lookup import find_group_hit
from kvtier.kv.groups import KVLayout, kv_layout
from kvtier.kv.hashing import group_key, hash_full_blocks, root_hash
from kvtier.router.groups import hybrid_prefix, hybrid_prompt_blocks, layout_of
from kvtier.router.replicas import ReplicaSet
from kvtier.server.kv_routes import kv_groups_json

F, S = "full_attention", "sliding_attention"
LAYOUTS = [
    kv_layout([S, S, F] * 2, 6),  # the tests' tiny Gemma 3: full (2, 5) | sliding (0, 3) | (1, 4)
    kv_layout([S] * 5 + [F], 3),  # Gemma 3's 5:1 pattern
    kv_layout([F, F, S, S], 9),  # Qwen3 with max_window_layers
    kv_layout([S, F, S, F, S, F, S], 5),  # a padded sliding group
    kv_layout([S, S], 4),  # no full group at all
]
EXTRA = ("fp:float32", "")


def cached_pool(layout: KVLayout, token_ids: list[int], block_size: int, p_held: float, rng: random.Random):
    """A pool holding each group's block of each position with probability ``p_held``; its keys."""
    chain = hash_full_blocks(token_ids, block_size, root_hash(EXTRA))
    pool = BlockPool(len(chain) * layout.num_groups + 1, enable_caching=True)
    held = set()
    for i, h in enumerate(chain):
        for g in range(layout.num_groups):
            if rng.random() < p_held:
                key = group_key(h, g)
                (block,) = pool.get_new_blocks(1)
                assert pool.cache_block(block, key, token_ids[i * block_size : (i + 1) * block_size], g)
                pool.free_blocks([block])  # cached idle: a device hit
                held.add(key)
    return pool, chain, held


def test_the_routers_hybrid_rule_is_the_engines_lookup() -> None:
    hits = []
    for seed in range(300):
        rng = random.Random(seed)
        layout = rng.choice(LAYOUTS)
        bs = rng.choice([1, 2, 4])
        tokens = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 50))]
        pool, chain, held = cached_pool(layout, tokens, bs, rng.choice([0.7, 0.9, 0.97, 1.0]), rng)
        engine = find_group_hit(pool, layout, bs, tokens, EXTRA, None).num_computed_tokens // bs
        local, remote = hybrid_prompt_blocks(
            layout, chain, len(tokens), bs, held.__contains__, lambda h: False
        )
        assert (local, remote) == (engine, 0), (seed, layout, bs, len(tokens))
        hits.append(engine)
    assert sum(1 for n in hits if n > 0) > 100 and max(hits) >= 20  # the cases are not trivial


def test_remote_blocks_extend_a_hybrid_hit() -> None:
    """The blocks of the last window are only in the shared remote tier: the local hit stops before that
    window, the remote part covers the rest."""
    layout = LAYOUTS[0]  # window 6 over blocks of 2: a hit of n blocks needs sliding blocks n-3 .. n-1
    tokens = list(range(3, 24))  # 21 tokens: at most 10 blocks
    chain = hash_full_blocks(tokens, 2, root_hash(EXTRA))
    everything = {group_key(h, g) for h in chain for g in range(3)}
    remote = {group_key(chain[9], g) for g in (1, 2)}  # the last window's last block, sliding groups

    def local(h: bytes) -> bool:
        return h in everything and h not in remote

    def keys(g: int, i: int) -> bytes:
        return group_key(chain[i], g)

    assert hybrid_prefix(layout, keys, 10, 2, local) == 9  # block 9 is in the windows of hits 10
    assert hybrid_prompt_blocks(layout, chain, len(tokens), 2, local, remote.__contains__) == (9, 1)


def test_the_layout_comes_from_kv_info() -> None:
    for layout in LAYOUTS:
        assert layout_of({"kv_groups": kv_groups_json(layout)}) == layout
    assert layout_of({}) is None  # a replica from before the groups: dense
    replicas = ReplicaSet(None, {})  # type: ignore[arg-type]  # no replica is called
    info = {"hash_spec_version": 1, "kv_groups": [{"group": 1, "kind": "full", "window": None}]}
    assert "listed at position 0" in (replicas._problem(info) or "")
    info["kv_groups"] = [{"group": 0, "kind": "sideways", "window": None}]
    assert "unknown KV group kind" in (replicas._problem(info) or "")
    info["kv_groups"] = kv_groups_json(LAYOUTS[0])
    assert replicas._problem(info) is None
    for bad in ("full", ["full"], [{"kind": "full", "window": "wide"}], []):
        with pytest.raises(ValueError, match="unreadable kv_groups"):
            layout_of({"kv_groups": bad})
