"""``SwapPlan``: the device↔host copies one scheduler step needs, planned once and run as a batch.

The KV manager's lower tiers accumulate the plan while the scheduler allocates; it travels in
``SchedulerOutput.swap`` and is executed before the forward::

    0. demotes  device block → bytes        (an evicted block the host tier has no room for: the
                                             bytes go straight down to an external tier)
    1. stores   device block → host block   (evicted cached blocks, write-through blocks, swap-out)
    2. loads    host block → device block   (prefix hits in the host tier, swap-in)
    3. copy-on-write copies, then the forward

Stores go first: a block evicted this step may be handed out again in the same step and be
overwritten by a load or by the forward. After the copies ran, the lower tiers' ``complete_plan``
publishes the stored keys and unpins the loaded ones.

A step may run its plan in parts: when an engine wires ``TierCoordinator.run_now``, a prefix hit's loads
run (with every store planned before them) the moment the hit is adopted, so the link is busy while the
rest of the step is scheduled; ``SchedulerOutput.swap`` is then what the step planned after them. The
parts run in order (on CUDA each waits for the previous one's copies through the compute stream).

Device blocks and host blocks are numbered separately: ``device_block_id`` indexes the device pool,
``host_block_id`` the host tier's buffer. Loads into fresh device blocks pair them with the host blocks
in the same order (``paired_ids``), so that consecutive host blocks land in consecutive device blocks
where the ids allow: one copy, no scatter (kvtier/transfer/copy_plan.py)::

    host blocks        40  41  42  43          fresh device blocks {7, 8, 9, 10}
    in key order        ->  7   8   9  10      (as handed out, tail first: 10 9 8 7, a scatter)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.kv.hashing import BlockHash


@dataclass
class Demote:
    """A device block written straight to external tier ``level`` (its index below the host tier) at
    ``address``, reserved there; the mover snapshots its bytes into ``data`` before any copy runs."""

    device_block_id: int
    key: BlockHash
    group: int
    level: int
    address: object
    data: memoryview | None = None


@dataclass
class SwapPlan:
    stores: list[tuple[int, int]] = field(default_factory=list)  # (device_block_id, host_block_id)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host_block_id, device_block_id)
    store_keys: list[BlockHash] = field(default_factory=list)  # one per store, same order
    load_keys: list[BlockHash] = field(default_factory=list)  # one per load, same order
    # Private blocks of swapped-in sequences: dropped from the host tier once loaded.
    discard_keys: list[BlockHash] = field(default_factory=list)
    demotes: list[Demote] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.stores and not self.loads and not self.discard_keys and not self.demotes

    def __len__(self) -> int:
        return len(self.stores) + len(self.loads)


def paired_ids(host_block_ids: Sequence[int], device_block_ids: Sequence[int]) -> list[int]:
    """``device_block_ids`` (interchangeable fresh blocks) reordered so that the k-th smallest host
    block takes the k-th smallest device block: the device block of each host block, in its order."""
    paired = [0] * len(host_block_ids)
    by_host = sorted(range(len(host_block_ids)), key=host_block_ids.__getitem__)
    for j, device in zip(by_host, sorted(device_block_ids), strict=True):
        paired[j] = device
    return paired
