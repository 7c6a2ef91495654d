"""``SwapPlan``: the device↔host copies one scheduler step needs, planned once and run as a batch.

The KV manager accumulates the plan while the scheduler allocates (seed 003's design); it travels
in ``SchedulerOutput.swap`` and the runner executes it before the forward::

    1. stores   device block → host slot   (evicted cached blocks, write-through blocks, swap-out)
    2. loads    host slot → device block   (prefix hits in the host tier, swap-in)
    3. copy-on-write copies, then the forward

Stores go first: a block evicted this step may be handed out again in the same step and be
overwritten by a load or by the forward. After the copies ran, ``TierCoordinator.complete_plan``
publishes the stored keys and unpins the loaded ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.tiers.base import BlockKey


@dataclass
class SwapPlan:
    stores: list[tuple[int, int]] = field(default_factory=list)  # (device_block_id, host_slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host_slot, device_block_id)
    store_keys: list[BlockKey] = field(default_factory=list)  # one per store, same order
    load_keys: list[BlockKey] = field(default_factory=list)  # one per load, same order
    # Private blocks of swapped-in sequences: dropped from the host tier once loaded.
    discard_keys: list[BlockKey] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.stores and not self.loads and not self.discard_keys

    def __len__(self) -> int:
        return len(self.stores) + len(self.loads)
