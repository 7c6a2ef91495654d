"""One layer of a random step for ``kvtier bench gpu``'s kernel rows: the Triton kernels against the torch
path on the same stored bytes, on the device under test.

The cached tokens of every sequence are written into shuffled blocks of a two-slot pool (the layer under
test is slot 1, so a slot's offset inside a block counts), the step's new tokens through the slot mapping
as the model writes them, and the metadata laid out as the runner lays it out: decode rows first, padded
tables, the mask of ragged contexts; prefill chunks with their block table and causal mask.
"""

from __future__ import annotations

import torch

from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillGroup, paged_attention, write_kv
from kvtier.models.kv_quant import KVFormat, PagedKVCache

LAYER, BLOCK_SIZE = 1, 16


def step_metadata(
    seqs: list[tuple[int, int]], tables: list[list[int]], bs: int, dev: torch.device
) -> AttentionMetadata:
    """The runner's metadata for these rows (``(cached, new)`` per sequence over its block table):
    decode rows (one new token after a cache) first, then prefill chunks (the Triton tests' too)."""
    decodes = [i for i, (c, n) in enumerate(seqs) if n == 1 and c > 0]
    chunks = [i for i in range(len(seqs)) if i not in decodes]
    slots = [(tables[i][p // bs], p % bs) for i in decodes + chunks for p in range(seqs[i][0], sum(seqs[i]))]
    decode = None
    if decodes:
        lens = [seqs[i][0] + 1 for i in decodes]
        max_blocks = -(-max(lens) // bs)
        rows = [tables[i] + tables[i][:1] * (max_blocks - len(tables[i])) for i in decodes]
        ctx = torch.tensor(lens, device=dev)
        mask = None
        if len(lens) > 1 and min(lens) != max(lens):
            mask = (torch.arange(max(lens), device=dev)[None, :] < ctx[:, None])[:, None, None, :]
        table = torch.tensor([b for row in rows for b in row], device=dev)
        decode = DecodeGroup(len(decodes), table, max_blocks, max(lens), mask)
    prefills, start = [], len(decodes)
    for i in chunks:
        c, n = seqs[i]
        if c == 0:  # a fresh chunk attends to its own rows
            prefills.append(PrefillGroup(start, n, 0, None, None))
        else:
            mask = torch.arange(c + n, device=dev)[None, :] <= torch.arange(c, c + n, device=dev)[:, None]
            prefills.append(PrefillGroup(start, n, c, torch.tensor(tables[i], device=dev), mask))
        start += n
    ids, offsets = (torch.tensor(x, device=dev) for x in zip(*slots, strict=True))
    return AttentionMetadata(ids, offsets, decode, prefills)


def compare(
    seqs: list[tuple[int, int]],  # (cached, new) per sequence; new == 1 after a cache: a decode row
    window: int | None,
    kv_dtype: str,
    compute: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dev: torch.device,
) -> float:
    """max |triton - torch| / max |torch| over one layer of the step (the torch path in float32 over a
    float32 twin of the pool holding the same bytes)."""
    gen = torch.Generator().manual_seed(0)
    sizes = [-(-(c + n) // BLOCK_SIZE) for c, n in seqs]
    num_blocks = sum(sizes) + 3
    shape = (2, BLOCK_SIZE, kv_heads, head_dim)
    cache = PagedKVCache(KVFormat(kv_dtype, compute), num_blocks, shape, dev)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(seqs))]
    for (c, _), table in zip(seqs, tables, strict=True):
        if c:
            kv = (torch.randn(c, 2, kv_heads, head_dim, generator=gen) * 2).to(compute).to(dev)
            pos = torch.arange(c, device=dev)
            cache.write(LAYER, kv, torch.tensor(table, device=dev)[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
    meta = step_metadata(seqs, tables, BLOCK_SIZE, dev)
    t = sum(n for _, n in seqs)
    kv = (torch.randn(t, 2, kv_heads, head_dim, generator=gen) * 2).to(compute).to(dev)
    q = (torch.randn(t, heads, head_dim, generator=gen) * 2).to(compute).to(dev)
    kv_new = write_kv(cache, LAYER, kv, meta)
    scale = head_dim**-0.5
    got = paged_attention(q, kv_new, cache, LAYER, meta, scale, "triton", window).float()
    twin = PagedKVCache(KVFormat(kv_dtype, torch.float32), num_blocks, shape, dev)
    twin.raw.copy_(cache.raw)
    want = paged_attention(q.float(), kv_new.float(), twin, LAYER, meta, scale, False, window)
    return float((got - want).abs().max() / want.abs().max())
