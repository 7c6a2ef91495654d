"""``two_way``: a step's stores and loads on two streams (CUDA) give the bytes the serial order gives.

On CUDA the mover stores on one stream and loads on another, so both directions of the link run at
once; a load waits for the store chunk that frees the device block it overwrites (or writes the host
block it reads). These tests check the plan on the CPU by replaying it in the most hostile order the
waits allow: every load as early as it may run, every store as late as it may run.
"""

from __future__ import annotations

import random

from kvtier.kv.plan import SwapPlan, paired_ids
from kvtier.transfer.copy_plan import consecutive, host_runs, load_runs, two_way

BIG = 10_000  # no run limit


def serial(plan: SwapPlan, device: list[str], host: list[str]) -> tuple[list[str], list[str]]:
    """The reference: every store, then every load (the order of one stream, and of the CPU path)."""
    device, host = device[:], host[:]
    for block_id, host_block_id in plan.stores:
        host[host_block_id] = device[block_id]
    for host_block_id, block_id in plan.loads:
        device[block_id] = host[host_block_id]
    return device, host


def hostile(
    plan: SwapPlan, device: list[str], host: list[str], chunks: int | None
) -> tuple[list[str], list[str]]:
    """``two_way``'s plan run with loads as early as their waits allow: each load runs before the first
    store chunk it does not wait for (a load that waits for none runs before any store)."""
    device, host = device[:], host[:]
    store_chunks, loads = two_way(plan, BIG, BIG, chunks)
    waits = [after for after, _ in loads]
    assert waits == sorted(waits, key=lambda a: -1 if a is None else a)  # one wait per chunk, in order

    def run_loads(up_to: int | None) -> None:
        for _, (h, devices) in [x for x in loads if x[0] == up_to]:
            for i, d in enumerate(devices):
                device[d] = host[h + i]

    run_loads(None)
    for c, chunk in enumerate(store_chunks):
        for h, devices in chunk:
            for i, d in enumerate(devices):
                host[h + i] = device[d]
        run_loads(c)
    return device, host


def test_a_load_into_an_evicted_block_waits_for_that_blocks_store() -> None:
    """The prefix's blocks come back into the very blocks whose old contents go down to the host."""
    device = [f"old{i}" for i in range(8)]
    host = [f"h{i}" for i in range(10)]
    plan = SwapPlan(stores=[(2, 0), (5, 1), (6, 2)], loads=[(4, 2), (5, 5), (6, 6), (9, 3)])
    store_chunks, loads = two_way(plan, BIG, BIG, chunks=3)
    assert store_chunks == [[(0, (2, 5, 6))]]  # host blocks 0, 1, 2: one run (its device blocks apart)
    assert loads == [(None, (9, (3,))), (0, (4, (2, 5, 6)))]  # block 3 was not stored: it goes first
    assert hostile(plan, device, host, 3) == serial(plan, device, host)


def test_a_load_of_a_host_block_a_store_writes_waits_for_it() -> None:
    plan = SwapPlan(stores=[(0, 3), (1, 5)], loads=[(3, 7)])
    _, loads = two_way(plan, BIG, BIG, chunks=2)
    assert loads == [(0, (3, (7,)))]
    device, host = ["a", "b"] + ["x"] * 6, ["h"] * 8
    assert hostile(plan, device, host, 2) == serial(plan, device, host)


def test_random_plans_in_the_hostile_order_equal_the_serial_order() -> None:
    """Stores of blocks being evicted, loads into them and into free blocks, scattered and in runs."""
    rng = random.Random(7)
    for trial in range(300):
        num_device, num_host = 40, 40
        device = [f"d{trial}.{i}" for i in range(num_device)]
        host = [f"h{trial}.{i}" for i in range(num_host)]
        evicted = rng.sample(range(num_device), rng.randint(0, 12))
        free = [b for b in range(num_device) if b not in evicted]
        host_slots = rng.sample(range(num_host), 24)
        stores = list(zip(evicted, host_slots, strict=False))
        targets = rng.sample(evicted, rng.randint(0, len(evicted))) + rng.sample(free, rng.randint(0, 6))
        sources = rng.sample(range(num_host), len(targets))  # may read a host block a store writes
        plan = SwapPlan(stores=stores, loads=list(zip(sources, targets, strict=True)))
        chunks = rng.choice([None, 1, 2, 3, 5])  # None: an event after every store run (the mover's)
        assert hostile(plan, device, host, chunks) == serial(plan, device, host), (trial, plan)


def test_with_an_event_per_store_run_each_load_waits_for_the_store_it_needs() -> None:
    """A prefix evicted tail first comes back into the blocks freed for it, in eviction order: the
    first load runs after the first store run, not after all of them."""
    stores = [(100 + i, 40 + i) for i in range(8)]  # device 100..107 -> host 40..47, in eviction order
    loads = [(7 - i, 100 + i) for i in range(8)]  # the prefix (host 0..7, tail first) into 100..107
    store_chunks, waits = two_way(SwapPlan(stores=stores, loads=loads), BIG, 2)
    assert [c[0][0] for c in store_chunks] == [40, 42, 44, 46]  # four runs of two: an event after each
    assert [(after, run[0]) for after, run in waits] == [(0, 6), (1, 4), (2, 2), (3, 0)]


def test_runs_stay_whole_and_no_stores_means_no_waits() -> None:
    plan = SwapPlan(loads=[(0, 10), (1, 11), (2, 12)])
    store_chunks, loads = two_way(plan, BIG, BIG)
    assert store_chunks == [] and loads == [(None, (0, (10, 11, 12)))]


def test_runs_follow_the_host_blocks_and_stop_at_chunks_and_their_size() -> None:
    """The device blocks of a run may be anywhere; a run ends where the host blocks jump, at a host
    chunk boundary, or at ``max_run`` blocks."""
    pairs = [(40, 7), (41, 2), (42, 9), (50, 3), (51, 4), (52, 5), (53, 6)]
    assert host_runs(pairs, 100, 100) == [(40, (7, 2, 9)), (50, (3, 4, 5, 6))]
    tail_first = SwapPlan(stores=[(9, 42), (2, 41), (7, 40)], loads=[(42, 1), (41, 8), (40, 3)])
    store_chunks, loads = two_way(tail_first, 100, 100, chunks=1)
    assert store_chunks == [[(40, (7, 2, 9))]] and loads == [(0, (40, (3, 8, 1)))]  # one run each
    assert host_runs(pairs, 52, 100) == [(40, (7, 2, 9)), (50, (3, 4)), (52, (5, 6))]
    assert host_runs(pairs, 100, 2) == [(40, (7, 2)), (42, (9,)), (50, (3, 4)), (52, (5, 6))]


def test_fresh_device_blocks_pair_with_the_host_blocks_in_order() -> None:
    """Host blocks 40-43 in key order, fresh device blocks handed out tail first (10, 9, 8, 7): paired in
    the host blocks' order they are one run of consecutive device blocks, one copy (was a scatter)."""
    host, fresh = [40, 41, 42, 43], [10, 9, 8, 7]
    assert paired_ids(host, fresh) == [7, 8, 9, 10]
    assert paired_ids([42, 40, 43, 41], fresh) == [9, 7, 10, 8]  # whatever order the keys come in
    plan = SwapPlan(loads=list(zip(host, paired_ids(host, fresh), strict=True)))
    assert [consecutive(devices) for _, devices in load_runs(plan, 64, 64)] == [True]
    unpaired = SwapPlan(loads=list(zip(host, fresh, strict=True)))
    assert [consecutive(devices) for _, devices in load_runs(unpaired, 64, 64)] == [False]
