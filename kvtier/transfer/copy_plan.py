"""How a step's block copies are grouped (torch-free): runs of consecutive host blocks, two streams.

A ``SwapPlan``'s pairs become *runs* of consecutive host block ids (never across a host chunk, at most
``max_run`` blocks). A run's device blocks may lie anywhere in the pool: the pool hands out blocks in
eviction order, so a prefix loaded back may land in scattered blocks while its host blocks are adjacent
(the host tier stores a sequence's evicted blocks one after another; the runs sort the pairs by host
block, since the pool evicts a sequence's tail first). Fresh blocks are paired in order on both sides
(``kvtier.kv.plan.paired_ids``), so a run is scattered only where the ids are. A run is ONE copy of
contiguous host bytes, plus, when its device blocks are not consecutive, one gather (a store) or
scatter (a load) on the device through a staging buffer: on an H200 an 8k-token prefix was 512
single-block copies, ~20 us of host time each (10 ms to enqueue 256 MiB) and 67% of a plain memcpy's
bandwidth::

    loads  (host, device)  (40, 7) (41, 2) (42, 9) (50, 3)   ->   runs (40, (7, 2, 9)), (50, (3,))
    stores (device, host)  (5, 10) (8, 11)                   ->   runs (10, (5, 8))

``two_way`` orders them for two CUDA streams: the stores (device -> host) on one, an event after each
run (or each of ``chunks`` chunks of runs), the loads (host -> device) on the other, each load waiting
for the last store that frees a device block it overwrites or writes a host block it reads, so both
directions of the link move at once. On an H200, 4 chunks of 64 MiB runs left an 8k prefix's loads
mostly behind its stores (5.0 ms down, then most of 5.4 ms up: runs cut at host chunk boundaries made
each load span two store chunks); runs of 16 MiB with an event each let a load follow the store it
needs by one run (not measured on a GPU yet).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.kv.plan import SwapPlan

Run = tuple[int, tuple[int, ...]]  # (first host block, the device block of each consecutive host block)


def host_runs(pairs: Sequence[tuple[int, int]], chunk_blocks: int, max_run: int) -> list[Run]:
    """``(host, device)`` pairs, in order, as runs where the host block advances by one; a run never
    crosses a multiple of ``chunk_blocks`` (a host chunk boundary) nor grows past ``max_run`` blocks."""
    runs: list[tuple[int, list[int]]] = []
    for host, device in pairs:
        if runs:
            first, devices = runs[-1]
            if host == first + len(devices) and host % chunk_blocks != 0 and len(devices) < max_run:
                devices.append(device)
                continue
        runs.append((host, [device]))
    return [(first, tuple(devices)) for first, devices in runs]


def consecutive(ids: Sequence[int]) -> bool:
    """Whether ``ids`` advance by one (a run whose device blocks are one slice of the pool)."""
    return all(b == ids[0] + i for i, b in enumerate(ids))


def store_runs(plan: SwapPlan, chunk_blocks: int, max_run: int) -> list[Run]:
    """The plan's stores by host block: each lands in a host block of its own, so their order is free
    (a sequence's blocks are evicted tail first: their host blocks come in descending order)."""
    return host_runs(sorted((h, d) for d, h in plan.stores), chunk_blocks, max_run)


def load_runs(plan: SwapPlan, chunk_blocks: int, max_run: int) -> list[Run]:
    """The plan's loads by host block (each fills a device block of its own: any order will do)."""
    return host_runs(sorted(plan.loads), chunk_blocks, max_run)


def two_way(
    plan: SwapPlan, chunk_blocks: int, max_run: int, chunks: int | None = None
) -> tuple[list[list[Run]], list[tuple[int | None, Run]]]:
    """The plan's store runs in up to ``chunks`` chunks (None: a chunk per run), and its load runs each
    with the chunk it waits for (None: none), in the order of their waits, so a stream waits for each
    chunk once."""
    runs = store_runs(plan, chunk_blocks, max_run)
    per = 1 if chunks is None else max(1, -(-len(runs) // chunks))
    store_chunks = [runs[i : i + per] for i in range(0, len(runs), per)]
    device_chunk: dict[int, int] = {}
    host_chunk: dict[int, int] = {}
    for c, chunk in enumerate(store_chunks):
        for host, devices in chunk:
            device_chunk.update(dict.fromkeys(devices, c))
            host_chunk.update(dict.fromkeys(range(host, host + len(devices)), c))
    loads: list[tuple[int | None, Run]] = []
    for host, devices in load_runs(plan, chunk_blocks, max_run):
        waits = [device_chunk.get(d, -1) for d in devices]
        waits += [host_chunk.get(h, -1) for h in range(host, host + len(devices))]
        after = max(waits)
        loads.append((None if after < 0 else after, (host, devices)))
    loads.sort(key=lambda load: -1 if load[0] is None else load[0])
    return store_chunks, loads
