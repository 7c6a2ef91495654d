"""HostTier bookkeeping: LRU order, reservations, pins, and the eviction hook used for demotion."""

from __future__ import annotations

import pytest

from kvtier.tiers.base import BlockKey
from kvtier.tiers.host import HostTier


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(32, b"."))


def store(tier: HostTier, *names: str) -> tuple[int, ...]:
    spec = tier.prepare_store([k(n) for n in names])
    tier.complete_store(spec.keys)
    return spec.addresses  # type: ignore[return-value]


def test_story_capacity_three_store_abc_load_a_store_d_evicts_b() -> None:
    evicted: list[tuple[BlockKey, int]] = []
    tier = HostTier(3, on_evict=lambda key, slot: evicted.append((key, slot)))
    slots = store(tier, "A", "B", "C")
    assert slots == (0, 1, 2)
    spec = tier.prepare_load([k("A")])
    tier.complete_load([k("A")])
    assert spec.addresses == (0,)
    store(tier, "D")
    assert evicted == [(k("B"), 1)]  # the hook sees the key and its slot before reuse
    assert tier.held_keys() == [k("C"), k("A"), k("D")] and tier.host_block_of(k("D")) == 1
    assert tier.lookup([k("A"), k("B"), k("C")]) == 1  # stops at the first miss
    tier.check_integrity()


def test_story_a_block_a_window_passed_is_evicted_first() -> None:
    """A returning Gemma turn loads its window's blocks from the host tier; once the turn's own window
    moved past them, nobody reads those copies again, yet they were the most recently used: the next
    evictions took a full-attention block a later turn needed. ``cool`` puts them first in line."""
    evicted: list[BlockKey] = []
    tier = HostTier(3, on_evict=lambda key, slot: evicted.append(key))
    store(tier, "full", "window-1", "window-2")
    tier.cool([k("window-2"), k("not-held")])  # keys it does not hold are ignored
    store(tier, "D")
    assert evicted == [k("window-2")]
    tier.check_integrity()


def test_reserved_keys_are_invisible_and_never_evicted() -> None:
    tier = HostTier(2)
    spec = tier.prepare_store([k("A"), k("B")])
    assert not tier.contains(k("A"))
    assert tier.prepare_store([k("C")]).keys == ()  # nothing evictable: C does not fit
    tier.complete_store([k("A")])
    tier.complete_store([k("B")], ok=False)  # a failed copy releases its slot
    assert tier.contains(k("A")) and not tier.contains(k("B")) and tier.num_used_blocks == 1
    assert spec.keys == (k("A"), k("B"))
    tier.check_integrity()


def test_pinned_blocks_survive_pressure_until_unpinned() -> None:
    tier = HostTier(2)
    store(tier, "A", "B")
    tier.pin([k("A")])
    store(tier, "C")  # must evict B, the only unpinned block
    assert tier.held_keys() == [k("A"), k("C")]
    tier.pin([k("C")])
    assert tier.prepare_store([k("D")]).keys == ()
    tier.unpin([k("A")])
    store(tier, "D")
    assert tier.held_keys() == [k("C"), k("D")]
    with pytest.raises(ValueError):
        tier.unpin([k("D")])
    tier.check_integrity()


def test_storing_a_held_key_again_is_skipped_and_discard_frees_unpinned() -> None:
    tier = HostTier(3)
    store(tier, "A")
    assert tier.prepare_store([k("A"), k("A")]).keys == ()
    tier.pin([k("A")])
    tier.discard([k("A")])
    assert tier.contains(k("A"))  # pinned: kept
    tier.unpin([k("A")])
    tier.discard([k("A")])
    assert tier.num_used_blocks == 0
    tier.check_integrity()


def test_a_batch_store_on_a_full_tier_evicts_in_one_pass_what_one_at_a_time_would() -> None:
    """A busy engine's load evicts hundreds of device blocks at once, each stored to a full host tier: one
    reservation walks the least recently used unpinned keys once, and takes the keys as if stored one by
    one: a held key is skipped, unless a key before it in the batch evicted it (then it is stored again)."""
    evicted: list[BlockKey] = []
    tier = HostTier(5, on_evict=lambda key, slot: evicted.append(key))
    store(tier, "A", "B", "C", "D", "E")
    tier.pin([k("B")])
    spec = tier.prepare_store([k("C"), k("F"), k("A"), k("G"), k("F"), k("E")])  # C and E held, F twice
    assert spec.keys == (k("F"), k("A"), k("G"))  # F evicts A, A evicts C, G evicts D; E stays held
    assert spec.evicted == (k("A"), k("C"), k("D")) == tuple(evicted)  # B is pinned
    one_by_one = HostTier(5)
    store(one_by_one, "A", "B", "C", "D", "E")
    one_by_one.pin([k("B")])
    assert [one_by_one.prepare_store([k(n)]).keys for n in "CFAGFE"] == [
        (),
        (k("F"),),
        (k("A"),),
        (k("G"),),
        (),
        (),
    ]
    tier.complete_store(spec.keys)
    assert tier.held_keys() == [k("B"), k("E"), k("F"), k("A"), k("G")]
    tier.pin([k("A"), k("F"), k("G")])
    spec = tier.prepare_store([k("X"), k("Y"), k("Z")])  # room for one: E, the last unpinned
    assert spec.keys == (k("X"),) and spec.evicted == (k("E"),)
    tier.check_integrity()
