"""Pure lookups of one KV group's prefix in the device pool (no reference taken, nothing counted).

    device_prefix      the leading full blocks of a prompt the device holds, at most all but the block
                       of its last token (that token is computed: it makes the logits)
    holds_last_block   whether the device or the host tier holds that last block all the same: a
                       prompt of whole blocks sent again was all in the cache, though its last block is
                       computed again (usage: nothing new was cached)

Hashes come from the manager's ``ChainMemo`` (a prompt's chain hashed once). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.kv.block_pool import BlockPool
from kvtier.kv.hashing import BlockHash, ChainMemo
from kvtier.kv.lower import LowerTiers


def device_prefix(
    pool: BlockPool, chains: ChainMemo, token_ids: Sequence[int], root: BlockHash
) -> tuple[list[int], list[BlockHash]]:
    """The ids and hashes of the leading full blocks of ``token_ids`` the device holds (at most
    ``(len(token_ids) - 1) // block_size``; stops at the first miss)."""
    bs = chains.block_size
    block_ids: list[int] = []
    chain: list[BlockHash] = []
    chains.extend(chain, token_ids, root, max(0, (len(token_ids) - 1) // bs) * bs)
    for i, key in enumerate(chain):
        block = pool.get_cached_block(key, token_ids[i * bs : (i + 1) * bs])
        if block is None:
            break
        block_ids.append(block.block_id)
    return block_ids, chain[: len(block_ids)]


def holds_last_block(
    pool: BlockPool,
    chains: ChainMemo,
    tiers: LowerTiers | None,
    token_ids: Sequence[int],
    root: BlockHash,
    hit_hashes: Sequence[BlockHash],
) -> bool:
    """Whether the device pool or the host tier holds the last full block of ``token_ids``;
    ``hit_hashes``: the chain of every block before it (a hit's). One block's hash and lookup."""
    bs = chains.block_size
    n = len(token_ids) // bs
    if n == 0 or len(hit_hashes) != n - 1:
        return False
    chain = list(hit_hashes)
    chains.extend(chain, token_ids, root, n * bs)
    if pool.get_cached_block(chain[-1], token_ids[(n - 1) * bs : n * bs]) is not None:
        return True
    return tiers is not None and tiers.num_host_hits(chain[-1:]) == 1
