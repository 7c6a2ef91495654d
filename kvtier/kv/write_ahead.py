"""Write-back ahead: while the engine idles, the cached blocks next in line for eviction are stored to
the host tier, so that the step that evicts them copies nothing down.

A write-back tier stores a device block when the pool hands it out again. The step that evicts it
pays for that copy, and it pays first: a prompt loaded back from the host tier into the blocks it
evicts waits for their old KV to leave before its own arrives (an 8k-token prefix on a 1B model:
256 MiB down, then 256 MiB up). An operating system cleans dirty pages ahead of need for the same
reason. Here, after a step with requests, the next idle moments plan the stores that evicting the
first ``num_blocks`` of the pool's eviction order would plan (``LowerTiers.write_back``), a few at a
time (``STEP_BLOCKS`` per idle step, so that a request arriving waits for little), once per
idle period. The blocks stay cached on the device; a later eviction finds them held below and plans
nothing. A block used again before its eviction has cost one copy and one host block early.

::

    step with requests ──► budget = num_blocks          (the pool's order changed)
    idle: plan()       ──► stores of the next evictions that a tier below lacks, <= STEP_BLOCKS
                           (none planned: the budget ends; the engine runs the copies)

Torch-free; the engine calls ``after_step``, ``pending`` and ``plan`` (``LLMEngine.settle_tiers``).
"""

from __future__ import annotations

import itertools

from kvtier.kv.block_pool import BlockPool
from kvtier.kv.lower import LowerTiers

STEP_BLOCKS = 64  # stores planned per idle step (the server looks for requests in between)


def default_blocks(max_num_batched_tokens: int, block_size: int, num_host_blocks: int) -> int:
    """One step's worth of blocks (the most a step's prompts can evict), at most half the host tier
    (more would evict the blocks it wrote back first)."""
    return min(max_num_batched_tokens // block_size, num_host_blocks // 2)


class WriteBackAhead:
    """Keeps the first ``num_blocks`` of the device pool's eviction order stored below (0: off)."""

    def __init__(
        self, pool: BlockPool, tiers: LowerTiers | None, num_blocks: int, step_blocks: int = STEP_BLOCKS
    ) -> None:
        if num_blocks < 0 or step_blocks < 1:
            raise ValueError(f"num_blocks must be >= 0 and step_blocks >= 1, got {num_blocks}, {step_blocks}")
        self.pool = pool
        self.tiers = tiers
        self.num_blocks = num_blocks if tiers is not None else 0
        self.step_blocks = step_blocks
        self._budget = 0  # stores this idle period may still plan

    def after_step(self) -> None:
        """A step with requests ran: the eviction order changed, look at it again when idle."""
        self._budget = self.num_blocks

    @property
    def pending(self) -> bool:
        return self._budget > 0

    def plan(self) -> int:
        """Plan up to ``step_blocks`` stores (the caller runs their copies); how many. Every store
        counts against the period's budget, so a host tier that evicts what was just written back
        cannot keep an idle engine copying."""
        if self._budget <= 0 or self.tiers is None:
            return 0
        most, planned = min(self.step_blocks, self._budget), 0
        for block in itertools.islice(self.pool.free_order(), self.num_blocks):
            if planned >= most:
                break
            key = block.block_hash
            if key is not None and self.tiers.write_back(block.block_id, key, block.group, block.cold):
                planned += 1
        self._budget = self._budget - planned if planned else 0
        return planned
