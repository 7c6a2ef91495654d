"""The longest prefix hit over several KV groups (a hybrid layout, ``kvtier/kv/groups.py``).

A hit of ``n`` blocks (``N = n * B`` tokens) lets the prompt's computation start at position ``N``. Its
first query, and every later one, reads in a full-attention group every block before ``N``, and in a
sliding group (window ``W``) only the blocks holding positions ``[max(0, N - W + 1), N)``::

    position        0   1   2   3   4   5   6   7 | 8 ...        (n = 8, W = 3 blocks' worth)
    full group      h   h   h   h   h   h   h   h |              all n blocks needed
    sliding group   .   .   .   .   .   h   h   h |              only the window's blocks needed
                    (null entries: never read again)

So the search is vLLM's hybrid one: the full groups give the longest prefix they all hold (a device
prefix, then what the lower tiers hold after it); the sliding groups then search *from the right*: the
largest ``n' <= n`` whose window every sliding group holds. A miss at position ``i`` rules out every
``n'`` in ``(i, n]`` at once (each of their windows contains ``i``), so the search jumps to ``n' = i``.
The full groups' prefixes are cut to ``n'``: the hit is exact, the rest is recomputed.

Lower tiers, kept simple (and exact): each full group asks them once for the blocks after its device
prefix (as a one-group lookup does); each sliding group asks once for the blocks that the device lacks
of the window at the prefix the full groups *will* hold once their pending reads land (``reach``: a
restart reads a whole prompt up from disk over several steps, and a window asked for at each step's
partial ``n`` would read blocks no final window needs and evict the ones it does). A shorter ``n'``
uses the device for any window position the lower tiers were not asked about. Before any read
starts, every host block of the prompt a hit could use is pinned until the search ends, so no
group's reads evict another group's hits of the same prompt (on a host tier not much larger than one
prompt's blocks they did: the reads of one returning prompt went round in circles, or a window's
blocks were pushed down to disk by the full group's reads); keys are still checked loadable at the
end. Pending reads of every lookup add up in ``ComputedBlocks.lower.num_pending_blocks``, so the
scheduler waits for them as for a one-group hit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.kv.block_pool import BlockPool, KVBlock
from kvtier.kv.computed import ComputedBlocks, GroupHit
from kvtier.kv.groups import KVLayout
from kvtier.kv.hashing import BlockHash, ExtraKey, group_key, hash_full_blocks, root_hash
from kvtier.kv.lower import NO_LOWER_HIT, LowerHit, LowerTiers
from kvtier.stats import Medium


@dataclass
class _FullRun:
    """A full group's prefix: leading device hits, then what the lower tiers hold right after."""

    device: list[KVBlock]
    lower: LowerHit

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.lower.host_keys)


def _truncated(hit: LowerHit, num_keys: int, num_pending: int) -> LowerHit:
    """``hit`` with its first ``num_keys`` host keys only, and ``num_pending`` pending reads."""
    sources = tuple(hit.source_of(j) for j in range(min(num_keys, len(hit.host_keys))))
    promoted = Counter(m for m in sources if m != Medium.HOST)
    return LowerHit(hit.host_keys[:num_keys], tuple(sorted(promoted.items())), num_pending, sources)


class _GroupSearch:
    """One lookup's state: group keys and device hits computed on demand, lower-tier answers."""

    def __init__(
        self,
        pool: BlockPool,
        layout: KVLayout,
        block_size: int,
        token_ids: Sequence[int],
        chain: list[BlockHash],
        tiers: LowerTiers | None,
    ) -> None:
        self.pool, self.layout, self.bs = pool, layout, block_size
        self.token_ids, self.chain, self.tiers = token_ids, chain, tiers
        self._keys: dict[tuple[int, int], BlockHash] = {}
        self._device: dict[tuple[int, int], KVBlock | None] = {}
        self.runs: dict[int, _FullRun] = {}  # full group -> its prefix
        self.reach = 0  # the full groups' prefix once their pending reads land (blocks)
        self.below: dict[tuple[int, int], tuple[BlockHash, Medium]] = {}  # sliding (g, i) loadable
        self.num_pending = 0
        self.held: list[BlockHash] = []  # host hits pinned for the search (``release``)

    def key(self, g: int, i: int) -> BlockHash:
        key = self._keys.get((g, i))
        if key is None:
            key = self._keys[(g, i)] = group_key(self.chain[i], g)
        return key

    def device(self, g: int, i: int) -> KVBlock | None:
        if (g, i) not in self._device:
            tokens = self.token_ids[i * self.bs : (i + 1) * self.bs]
            self._device[(g, i)] = self.pool.get_cached_block(self.key(g, i), tokens)
        return self._device[(g, i)]

    def first(self, g: int, n: int) -> int:
        """The first block position group ``g`` needs for a hit of ``n`` blocks."""
        return self.layout.groups[g].first_reachable_block(n * self.bs, self.bs)

    def _lookup_below(self, keys: list[BlockHash], g: int) -> LowerHit:
        if self.tiers is None or not keys:
            return NO_LOWER_HIT
        hit = self.tiers.lookup(keys, g)  # reads below check each block's group
        self.tiers.hold(hit.host_keys)  # until the search ends: the next groups' reads evict around them
        self.held.extend(hit.host_keys)
        self.num_pending += hit.num_pending_blocks
        return hit

    def full_groups(self, n: int) -> int:
        """The longest prefix (at most ``n`` blocks) every full group holds on the device or below;
        sets ``reach``, the prefix they will hold once their pending reads land."""
        self.reach = n
        for g, spec in enumerate(self.layout.groups):
            if spec.window is not None:
                continue
            device: list[KVBlock] = []
            while len(device) < n and (block := self.device(g, len(device))) is not None:
                device.append(block)
            lower = self._lookup_below([self.key(g, i) for i in range(len(device), n)], g)
            self.runs[g] = run = _FullRun(device, lower)
            n = min(n, run.num_blocks)
            self.reach = min(self.reach, run.num_blocks + lower.num_pending_blocks)
        return n

    def ask_below_for_windows(self, n: int) -> None:
        """Each sliding group asks the lower tiers, once, for the blocks of its window at ``n`` (the
        full groups' ``reach``) that the device lacks; the leading ones they hold become loadable."""
        for g, spec in enumerate(self.layout.groups):
            if spec.window is None:
                continue
            missing = [i for i in range(self.first(g, n), n) if self.device(g, i) is None]
            hit = self._lookup_below([self.key(g, i) for i in missing], g)
            for j, i in enumerate(missing[: len(hit.host_keys)]):
                self.below[(g, i)] = (hit.host_keys[j], hit.source_of(j))

    def pin_host_hits(self, max_blocks: int) -> None:
        """Before any read starts, pin every host block of this prompt a hit could use: each full
        group's after the device, each sliding group's from the window at the shortest prefix the full
        groups hold without a read (the final window starts there or later). A read reserves its host
        block by evicting the least recently used one, which would otherwise be one of these."""
        tiers = self.tiers
        assert tiers is not None
        full = [g for g, spec in enumerate(self.layout.groups) if spec.window is None]
        held = self._on_device_or_host
        n_min = min(next((i for i in range(max_blocks) if not held(g, i)), max_blocks) for g in full)
        keys = [
            self.key(g, i)
            for g, spec in enumerate(self.layout.groups)
            for i in range(0 if spec.window is None else self.first(g, n_min), max_blocks)
            if self.device(g, i) is None and tiers.can_load([self.key(g, i)])
        ]
        tiers.hold(keys)
        self.held.extend(keys)

    def _on_device_or_host(self, g: int, i: int) -> bool:
        assert self.tiers is not None
        return self.device(g, i) is not None or self.tiers.can_load([self.key(g, i)])

    def release(self) -> None:
        """Drop the search's pins on its host hits (adopting the hit pins them again: ``hold``)."""
        if self.tiers is not None and self.held:
            self.tiers.unhold(self.held)
        self.held = []

    def drop_unloadable(self, n: int) -> int:
        """Forget lower-tier blocks no longer loadable (a later lookup's reads evicted them); returns
        ``n`` cut to what the full groups still hold."""
        tiers = self.tiers
        if tiers is None:
            return n
        for run in self.runs.values():
            keys = run.lower.host_keys
            num_ok = next((j for j, key in enumerate(keys) if not tiers.can_load([key])), len(keys))
            if num_ok < len(keys):
                run.lower = _truncated(run.lower, num_ok, run.lower.num_pending_blocks)
            n = min(n, run.num_blocks)
        self.below = {gi: kept for gi, kept in self.below.items() if tiers.can_load([kept[0]])}
        return n

    def _held(self, g: int, i: int) -> bool:
        return (g, i) in self.below or self.device(g, i) is not None

    def sliding_from_right(self, n: int) -> int:
        """The largest ``n' <= n`` whose window every sliding group holds (0 when none does)."""
        sliding = [g for g, spec in enumerate(self.layout.groups) if spec.window is not None]
        end = n
        while end > 0:
            gap = next(
                (
                    i
                    for g in sliding
                    for i in range(end - 1, self.first(g, end) - 1, -1)
                    if not self._held(g, i)
                ),
                None,
            )
            if gap is None:
                return end
            end = gap  # every window ending in (gap, end] contains the gap
        return 0

    def group_hit(self, g: int, n: int) -> GroupHit:
        """Group ``g``'s table entries for a hit of ``n`` blocks."""
        run = self.runs.get(g)
        first = self.first(g, n)
        ids: list[int | None] = []
        sources: list[Medium] = []
        for i in range(first, n):
            block = run.device[i] if run is not None and i < len(run.device) else self.device(g, i)
            if block is not None:
                ids.append(block.block_id)
                sources.append(Medium.DEVICE)
            else:
                ids.append(None)
                sources.append(run.lower.source_of(i - len(run.device)) if run else self.below[(g, i)][1])
        keys = tuple(self.key(g, i) for i in range(first, n))
        return GroupHit(first, tuple(ids), keys, tuple(sources))


def find_group_hit(
    pool: BlockPool,
    layout: KVLayout,
    block_size: int,
    token_ids: Sequence[int],
    extra_keys: tuple[ExtraKey, ...],
    tiers: LowerTiers | None,
) -> ComputedBlocks:
    """The longest exact prefix hit of ``token_ids`` over every group of ``layout`` (at most
    ``(len(token_ids) - 1) // block_size`` blocks); takes no reference, counts nothing. With
    ``tiers`` None only the device pool is asked (the scheduler's estimate)."""
    bs = block_size
    max_blocks = max(0, (len(token_ids) - 1) // bs)
    chain = hash_full_blocks(token_ids, bs, root_hash(extra_keys), 0, max_blocks * bs)
    search = _GroupSearch(pool, layout, bs, token_ids, chain, tiers)
    try:
        if tiers is not None and layout.has_sliding:
            search.pin_host_hits(max_blocks)
        n = search.full_groups(max_blocks)
        if layout.has_sliding:
            search.ask_below_for_windows(max(n, search.reach))
        n = search.sliding_from_right(search.drop_unloadable(n))
    finally:
        search.release()
    groups = tuple(search.group_hit(g, n) for g in range(layout.num_groups))
    head = groups[0]  # group 0: the flat fields (statistics, tokens by tier, the observers)
    device_ids = tuple(i for i in head.block_ids if i is not None)
    loads = [j for j, i in enumerate(head.block_ids) if i is None]
    lower = LowerHit(
        tuple(head.keys[j] for j in loads),
        tuple(sorted(Counter(head.sources[j] for j in loads if head.sources[j] != Medium.HOST).items())),
        search.num_pending,
        tuple(head.sources[j] for j in loads),
    )
    return ComputedBlocks(device_ids, n * bs, tuple(chain[:n]), lower, len(token_ids), max_blocks, groups)
