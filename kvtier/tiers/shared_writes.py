"""What goes down to the write-through shared tier (Redis) beyond the blocks the host tier evicts.

::

    publish(keys)       disaggregated prefill: where a prompt's blocks stand in the shared tier
                        (held, on their way, missing), writing down the host blocks it lacks
    republish(level)    a shared tier back from an outage may be empty (a restarted Redis): the host
                        tier's blocks are written to it again, a few per step, newest first
    presence()          the shared tier's own count of a prompt's blocks, safe from any thread

The coordinator owns the levels and their writes (``store_down``); this only picks the host blocks.
Keys of swapped-out sequences' private blocks never go down. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kvtier.stats import Medium
from kvtier.tiers.base import BlockKey
from kvtier.tiers.external_level import ExternalLevel, SharedProgress
from kvtier.tiers.host import HostTier

REPUBLISH_IN_FLIGHT = 32  # host blocks written again after an outage at once (each a copy in memory)


class SharedWrites:
    def __init__(
        self,
        external: Sequence[ExternalLevel],
        host: HostTier,
        private: Collection[BlockKey],
        store_down: Callable[[ExternalLevel, Sequence[BlockKey]], None],
    ) -> None:
        self.external, self.host, self.private, self.store_down = external, host, private, store_down

    def level(self) -> ExternalLevel | None:
        """The shared tier's level when it is written through (None: no such tier)."""
        level = next((lv for lv in self.external if lv.tier.medium == Medium.REMOTE), None)
        return level if level is not None and level.policy == "write_through" else None

    def presence(self) -> Callable[[Sequence[BlockKey]], int | None] | None:
        """The write-through shared tier's own count of how many of a prompt's keys it holds, safe to
        call from any thread (``RemoteTier.presence``); None without such a tier."""
        level = self.level()
        presence = getattr(level.tier, "presence", None) if level is not None else None
        return presence() if presence is not None else None

    def publish(self, keys: Sequence[BlockKey], planned: Collection[BlockKey]) -> SharedProgress:
        """Where ``keys`` (a prompt's full blocks, KV group 0's keys) stand in the write-through shared
        tier, writing down the host blocks it lacks and is not getting (evicted from it, or written while
        it was down); a key in ``planned`` (the pending step's stores) counts as storing."""
        level = self.level()
        if level is None or not level.tier.accepting:
            return SharedProgress(0, 0, len(keys), active=False)
        held = storing = 0
        down = []
        for key in dict.fromkeys(keys):
            if level.tier.contains(key, self.host.group_of(key)):
                held += 1
            elif key in level.storing or key in planned:
                storing += 1
            elif self.host.contains(key) and key not in self.private:
                down.append(key)
        self.store_down(level, down)
        storing += sum(1 for key in down if key in level.storing)
        return SharedProgress(held, storing, len(dict.fromkeys(keys)) - held - storing, active=True)

    def republish(self, level: ExternalLevel) -> None:
        """A write-through tier that came back after an outage may be empty (a restarted Redis): write
        the host tier's blocks to it again, a few per step (at most ``REPUBLISH_IN_FLIGHT`` copies in
        memory), newest first. Another replica may need them: a conversation that moved between
        replicas has its blocks in both, and the shared copy was the only one the other could load.
        Blocks the store still holds cost one EXISTS each (``RedisBlockIO.write_batch``)."""
        generation = getattr(level.tier, "generation", None)
        if generation is None or level.policy != "write_through" or not level.tier.accepting:
            return
        if level.generation != generation:
            if level.generation is not None:  # not at start-up: nothing was lost then
                level.republish = [k for k in self.host.held_keys() if k not in self.private]
            level.generation = generation
        room = REPUBLISH_IN_FLIGHT - len(level.storing)
        if level.republish and room > 0:
            batch = [level.republish.pop() for _ in range(min(room, len(level.republish)))]
            self.store_down(level, [k for k in batch if self.host.host_block_of(k) is not None])
