"""A row whose logits the model gave non-finite: find the corrupt K/V blocks, blame their tier, contain.

::

    sampler: RowError(model=True) for sequence s
    corrupt_blocks(cache, s's tables)  the blocks of s holding NaN/inf K/V (dequantized when compact),
                                       over every KV group's table (null entries skipped)
    blame(kv, corrupt)                 each one's key, by the tier it was loaded from (KVCacheManager's
                                       origins); a block computed here (or a device hit computed here
                                       earlier) has no tier to blame: its key is only forgotten
    contain(...)                       quarantine each blamed tier (the canary's action: its keys are
                                       forgotten everywhere, nothing more loads from it), forget the rest,
                                       zero the corrupt blocks, and name the other live requests whose
                                       tables hold them (their K/V is as corrupt: they end with the error)

Zeroing matters: attention masks a padded or not-yet-written slot by a zero weight, and 0 x NaN is NaN,
so a freed block left holding NaN would spoil whichever request reuses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from kvtier.insight.canary import block_values
from kvtier.kv.groups import NULL_BLOCK_ID
from kvtier.kv.hashing import BlockHash
from kvtier.kv.manager import KVCacheManager
from kvtier.models.kv_quant import PagedKVCache
from kvtier.sequence import Request
from kvtier.stats import Medium
from kvtier.tiers.coordinator import TierCoordinator

logger = logging.getLogger("kvtier.engine")


@dataclass
class Blame:
    """The corrupt blocks' keys by the tier they came from, and those computed on this device."""

    by_tier: dict[Medium, list[BlockHash]] = field(default_factory=dict)
    computed: list[BlockHash] = field(default_factory=list)


def corrupt_blocks(cache: PagedKVCache, block_ids: Iterable[int]) -> list[int]:
    """The blocks among ``block_ids`` whose K/V values are not all finite."""
    raw = cache.raw
    return [
        b for b in dict.fromkeys(block_ids) if not bool(torch.isfinite(block_values(cache, raw[b])).all())
    ]


def held_blocks(kv: KVCacheManager, seq_id: str) -> list[int]:
    """Every device block ``seq_id``'s tables hold, over its KV groups (a sliding group's released,
    null entries left out); ``KeyError`` when it holds none (waiting, or swapped out)."""
    return [b for table in kv.block_tables(seq_id) for b in table if b != NULL_BLOCK_ID]


def blame(kv: KVCacheManager, bad: list[int]) -> Blame:
    """Each corrupt block's key by the lower tier its bytes were loaded from (none: computed here)."""
    _, origins = kv.block_map()
    found = Blame()
    for block_id in bad:
        key = kv.pool.blocks[block_id].block_hash
        if key is None:
            continue  # not cached under a key: nothing can hit it again once zeroed
        medium = origins.get(block_id)
        if medium is None or medium == Medium.DEVICE:
            found.computed.append(key)
        else:
            found.by_tier.setdefault(medium, []).append(key)
    return found


def holders(kv: KVCacheManager, requests: Mapping[str, Request], bad: list[int]) -> list[str]:
    """The live requests one of whose sequences has a block of ``bad`` in its table."""
    wanted = set(bad)
    found = []
    for request_id, request in requests.items():
        for seq in request.seqs:
            try:
                table = held_blocks(kv, seq.seq_id)
            except KeyError:  # waiting without blocks, or swapped out
                continue
            if wanted.intersection(table):
                found.append(request_id)
                break
    return found


def contain(
    kv: KVCacheManager,
    cache: PagedKVCache,
    tiers: TierCoordinator | None,
    requests: Mapping[str, Request],
    seq_id: str,
    quarantine: Callable[[Medium, list[BlockHash]], None],
) -> list[str]:
    """Contain the corrupt K/V behind ``seq_id``'s non-finite logits (see the module's doc); returns
    the ids of the live requests whose tables hold a corrupt block (``seq_id``'s own included)."""
    try:
        table = held_blocks(kv, seq_id)
    except KeyError:
        return []
    bad = corrupt_blocks(cache, table)
    if not bad:
        logger.error("%s: non-finite logits with finite K/V (the model overflowed?)", seq_id)
        return []
    found = blame(kv, bad)
    for medium, keys in found.by_tier.items():
        logger.error(
            "%s: %d block(s) loaded from the %s tier hold non-finite K/V (%s); quarantining the %s tier",
            seq_id,
            len(keys),
            medium,
            ", ".join(k.hex() for k in keys),
            medium,
        )
        quarantine(medium, keys)
    for key in found.computed:
        kv.forget_block(key)
        if tiers is not None:
            tiers.forget(key, "non-finite K/V")
    holding = holders(kv, requests, bad)
    cache.raw[torch.tensor(bad, dtype=torch.long, device=cache.raw.device)] = 0
    return holding
