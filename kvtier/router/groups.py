"""A hybrid replica's prefix, scored over its KV groups the way its engine looks it up.

A hybrid model (Gemma 3: full-attention and sliding-window layers) keeps its KV in several groups
(``kvtier/kv/groups.py``); group ``g``'s block ``i`` is announced under ``group_key(h_i, g)`` (group 0:
``h_i`` itself). A replica can serve a hit of ``n`` blocks only if it holds::

    block           0   1   2   3   4   5   6   7 | 8 ...        (n = 8, window W = 3 blocks' worth)
    full groups     h   h   h   h   h   h   h   h |              every block before n
    sliding groups  .   .   .   .   .   h   h   h |              the blocks of the window before n

so the full-attention group 0 alone overstates a replica whose sliding blocks were evicted, and a
replica holding the full blocks only is worth less than one holding both. :func:`hybrid_prefix` is the
engine's rule (``kvtier/kv/group_lookup.py``): the longest prefix every full group holds, then the
largest ``n' <= n`` whose window every sliding group holds, searched from the right (a missing block at
``i`` rules out every ``n'`` whose window contains it, so the search jumps to ``n' = i``). It is capped,
like the engine's lookup, at ``(num_tokens - 1) // block_size`` blocks: the last token is always
computed. A sliding group's keys are hashed only for the windows it tries (a few per prompt).

The layout comes from the replica's ``GET /v1/kv/info`` (``kv_groups``; a replica without it is dense).
A dense layout (one full group) is scored as before, by the leading hashes alone
(``kvtier.router.index.prompt_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from kvtier.kv.groups import KVGroupSpec, KVLayout
from kvtier.kv.hashing import BlockHash, group_key
from kvtier.router.index import LOCAL_BITS, ReplicaIndex


def layout_of(info: dict[str, Any] | None) -> KVLayout | None:
    """The KV layout a replica reports (``kv_groups`` of ``/v1/kv/info``, group 0 first); None when it
    reports none (a replica from before the groups: dense). ValueError for one that cannot be read."""
    groups = (info or {}).get("kv_groups")
    if groups is None:
        return None
    try:
        if not isinstance(groups, list) or not groups:
            raise ValueError("not a list of groups")
        key = tuple(_group_key(position, g) for position, g in enumerate(groups))
        return _layout(key)
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"unreadable kv_groups {groups!r}: {exc}") from None


def _group_key(position: int, g: dict[str, Any]) -> tuple[str, int | None, tuple[int, ...]]:
    if g.get("group", position) != position:
        raise ValueError(f"group {g.get('group')!r} listed at position {position}")
    window = g.get("window")
    return (
        str(g["kind"]),
        None if window is None else int(window),
        tuple(int(x) for x in g.get("layers") or ()),
    )


@lru_cache(maxsize=64)
def _layout(groups: tuple[tuple[str, int | None, tuple[int, ...]], ...]) -> KVLayout:
    """The layout of parsed ``kv_groups`` (cached: every decision asks)."""
    specs = tuple(KVGroupSpec(kind, window, layers) for kind, window, layers in groups)  # type: ignore[arg-type]
    return KVLayout(specs, max(1, *(len(spec.layers) for spec in specs)))


class _Keys:
    """A prompt's group keys, hashed on first use (group 0's are the chain itself)."""

    def __init__(self, chain: Sequence[BlockHash]) -> None:
        self.chain = chain
        self._keys: dict[tuple[int, int], BlockHash] = {}

    def __call__(self, g: int, i: int) -> BlockHash:
        if g == 0:
            return self.chain[i]
        key = self._keys.get((g, i))
        if key is None:
            key = self._keys[(g, i)] = group_key(self.chain[i], g)
        return key


def hybrid_prefix(
    layout: KVLayout,
    keys: Callable[[int, int], BlockHash],
    num_blocks: int,
    block_size: int,
    held: Callable[[BlockHash], bool],
) -> int:
    """The longest hit (in blocks, at most ``num_blocks``) a replica holding the keys ``held`` accepts
    serves: every full group's blocks before it, each sliding group's window before it."""
    n = num_blocks
    for g, spec in enumerate(layout.groups):
        if spec.window is None:
            n = next((i for i in range(n) if not held(keys(g, i))), n)
    sliding = [(g, spec) for g, spec in enumerate(layout.groups) if spec.window is not None]
    end = n
    while end > 0:
        gap = next(
            (
                i
                for g, spec in sliding
                for i in range(end - 1, spec.first_reachable_block(end * block_size, block_size) - 1, -1)
                if not held(keys(g, i))
            ),
            None,
        )
        if gap is None:
            return end
        end = gap  # every window ending in (gap, end] contains the gap
    return 0


def hybrid_prompt_blocks(
    layout: KVLayout,
    chain: Sequence[BlockHash],
    num_tokens: int,
    block_size: int,
    local: Callable[[BlockHash], bool],
    remote: Callable[[BlockHash], bool],
) -> tuple[int, int]:
    """``(local, remote)`` blocks of one prompt on a hybrid replica: the longest hit its own media
    (device, host, disk) hold in every group, and how much longer the hit is when the blocks some
    replica announced in the shared remote tier count too."""
    num_blocks = min(len(chain), max(0, (num_tokens - 1) // block_size))
    keys = _Keys(chain)
    on_own = hybrid_prefix(layout, keys, num_blocks, block_size, local)
    with_remote = hybrid_prefix(layout, keys, num_blocks, block_size, lambda h: local(h) or remote(h))
    return on_own, max(0, with_remote - on_own)


def request_blocks(
    layout: KVLayout,
    index: ReplicaIndex,
    indexes: Sequence[ReplicaIndex],
    chains: Sequence[Sequence[BlockHash]],
    num_tokens: Sequence[int],
    block_size: int,
) -> tuple[int, int]:
    """``(local, remote)`` blocks of a request's prompts (one chain and token count each) on the hybrid
    replica of ``index``, summed over the prompts (:func:`hybrid_prompt_blocks`; the remote tier is
    every scorable replica's announcements, ``indexes``)."""

    def local(h: BlockHash) -> bool:
        return bool(index.held.get(h, 0) & LOCAL_BITS)

    def remote(h: BlockHash) -> bool:
        return any(other.has_remote(h) for other in indexes)

    total_local = total_remote = 0
    for chain, n in zip(chains, num_tokens, strict=True):
        on_own, below = hybrid_prompt_blocks(layout, chain, n, block_size, local, remote)
        total_local += on_own
        total_remote += below
    return total_local, total_remote
