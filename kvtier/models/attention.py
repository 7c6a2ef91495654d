"""Paged attention over the block-major KV pool.

The device KV pool is one tensor (``PagedKVCache.raw``, ``kvtier/models/kv_quant.py``)::

    kv_cache: [num_blocks, num_slots, block_size, 2, num_kv_heads, head_dim]
               └─ one block = K and V of block_size tokens in each layer slot of a KV group,
                  contiguous, so a tier transfer moves a block with a single indexed copy.
    (fp8/int8 KV: uint8 [num_blocks, num_slots, layer_bytes], each slot row = data | scales)

A dense model has one KV group whose slots are its layers (num_slots = num_layers). A hybrid one
(``kvtier/kv/groups.py``) has several groups of ``num_slots`` layers each over the same pool: each
group has its own ``AttentionMetadata`` (slot mapping and block tables), and a layer reads and writes
its slot of its group's blocks (``LlamaModel.layer_kv``). Below, ``layer`` is that slot.

A step's tokens are flattened to ``T`` rows (decodes first, then prefill chunks). Attention reads
K/V only through block tables and writes new K/V only through slot mappings (block id, offset):

    write:  kv_cache[slot_block_ids[t], layer, slot_offsets[t]] = kv_new[t]          # [2, KVH, D]
            (quantized per token and KV head on the way in with a compact KV dtype)
    read:   rows = kv_layer.index_select(0, block_table)  ->  [n_blocks, BS, 2, KVH, D]
                                                          ->  [ctx, 2, KVH, D]
            (a view with ``auto``; with a compact KV dtype prefill chunks dequantize what they gather)
    decode, fp32 compute on CPU (every KV dtype but float16): no gather; the fused kernel of
            ``kvkernels.py`` walks the block table over the pool itself, one pass over K and one over
            V per layer, a compact token's scale folded into its score and probability (the torch
            path, SDPA or ``decode_attention_scaled``, is the fallback where the kernel is unavailable)

Decode rows (one query token each) run as one batched group padded to the longest context with a
boolean mask; each prefill chunk runs as its own group with a causal mask offset by the tokens it
already has in cache. K/V heads are never repeated for grouped-query attention: decode folds the
query heads that share a KV head into the query axis, prefill uses SDPA's native GQA.

A sliding-window layer (``window`` W, HF's ``sliding_attention``) lets the query at position q see
the keys at positions q - W < k <= q: the W latest tokens, itself included. It reads only the blocks
that hold those keys: a chunk's table starts at the block of its first query's oldest key, a decode
group's rows are re-cut from each sequence's own first window block (``DecodeGroup.window``)::

    positions   0 .. 3 | 4 .. 7 | 8 .. 11 | 12 .. 15       W = 6, decode of q = 13 (context 14)
    window                          8 ....... 13           keys 8..13: blocks 2 and 3 are read,
    mask of the view                T  T  T  T | T  T  F  F   0 and 1 are not

While a group's longest context fits in the window the mask is the full one (the window cuts nothing),
and the fused decode kernel runs as for a full layer; past it, the window's decode rows run through
torch (the kernel walks each context from its first token).

With the ``triton`` attention backend (``attention_backend.py``, ``kernel="triton"``) every row runs
through ``triton_attention.py`` instead: decode and prefill kernels that walk the block tables over the
pool themselves (no gather, no padded mask; a sliding layer's window is a start position), imported only
then. This torch path stays the reference they are tested against.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvtier.models import kvkernels
from kvtier.models.attention_backend import TRITON, C
from kvtier.models.kv_quant import PagedKVCache


@dataclass
class DecodeGroup:
    """``num_seqs`` sequences with one new token each: rows [0, num_seqs) of the step."""

    num_seqs: int
    block_tables: torch.Tensor  # [B * max_blocks] long, flattened padded block tables
    max_blocks: int
    max_context: int  # longest context in the group (tokens incl. the new one)
    mask: torch.Tensor | None  # [B, 1, 1, max_context] bool (True = attend); None when B == 1
    # [B] long tokens per sequence, the length of each mask row's True prefix: ``context_lens()``
    _lens: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # [B] the same lengths as host ints, when the model runner has them: ``_cut`` reads no device value
    _host_lens: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)
    # the decode kernel's call for this step, prepared at the first layer: ``kernel_call()``
    _call: kvkernels.StepCall | None = field(default=None, init=False, repr=False, compare=False)
    # sliding-window views by (window, block size), built at the first sliding layer: ``window()``
    _windows: dict[tuple[int, int], DecodeWindow | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def context_lens(self) -> torch.Tensor | None:
        """[B] long context lengths (the mask's rows are prefixes), counted once per step and kept for
        the other layers; None when every sequence has ``max_context`` tokens (no mask)."""
        if self.mask is not None and self._lens is None:
            self._lens = self.mask.reshape(self.num_seqs, -1).sum(-1)
        return self._lens

    def kernel_call(
        self, lib: ctypes.CDLL, kv_cache: PagedKVCache, num_heads: int, scale: float
    ) -> kvkernels.StepCall:
        """The decode kernel's call over ``kv_cache``, its per-step arguments converted once for every
        layer of the step."""
        if self._call is None or self._call.cache is not kv_cache:
            lens = self.context_lens()
            args = (self.block_tables, lens, self.num_seqs, self.max_context, scale)
            self._call = kvkernels.StepCall(lib, kv_cache, num_heads, *args)
        return self._call

    def window(self, window: int, block_size: int) -> DecodeWindow | None:
        """The group's rows cut to the blocks a ``window``-token sliding layer reads, with the mask of
        the keys it sees (q - W < k <= q); None when every context fits in the window (the full rows and
        mask are the window's then). Built once per step and window."""
        key = (window, block_size)
        if key not in self._windows:
            self._windows[key] = None if self.max_context <= window else self._cut(window, block_size)
        return self._windows[key]

    def _cut(self, window: int, block_size: int) -> DecodeWindow:
        b, dev = self.num_seqs, self.block_tables.device
        lens = self.context_lens()
        if lens is None:
            lens = torch.full((b,), self.max_context, dtype=torch.long, device=dev)
        first = (lens - window).clamp_min(0) // block_size  # [B] first block holding a key in the window
        last = (lens - 1) // block_size  # [B] the block of the new token
        n = self._window_blocks(window, block_size)
        if n is None:  # no host lengths: read the device's (a sync on CUDA)
            n = int((last - first).max()) + 1
        col = torch.arange(n, device=dev)
        # [B, n] block indices; past a row's own last block it repeats it (masked, never another's block)
        idx = torch.minimum(first[:, None] + col[None, :], last[:, None])
        tables = self.block_tables.view(b, self.max_blocks).gather(1, idx).reshape(-1)
        pos = first[:, None] * block_size + torch.arange(n * block_size, device=dev)[None, :]  # [B, n*BS]
        mask = (pos < lens[:, None]) & (pos >= lens[:, None] - window)
        return DecodeWindow(tables, n, mask[:, None, None, :])

    def _window_blocks(self, window: int, block_size: int) -> int | None:
        """The most blocks a row's window spans (``_cut``'s ``n``), counted on the host: from
        ``max_context`` when every row has it (no mask), else from the runner's host lengths; None
        without them."""
        lens = (self.max_context,) if self.mask is None else self._host_lens
        if lens is None:
            return None
        return max((k - 1) // block_size - max(0, k - window) // block_size for k in lens) + 1


@dataclass(frozen=True)
class DecodeWindow:
    """A decode group's rows as a sliding layer reads them (``DecodeGroup.window``)."""

    block_tables: torch.Tensor  # [B * num_blocks] long: each row from its first window block on
    num_blocks: int
    mask: torch.Tensor  # [B, 1, 1, num_blocks * BS] bool: the keys q - W < k <= q of each row


@dataclass
class PrefillGroup:
    """One sequence's chunk of ``num_tokens`` new tokens after ``num_cached`` tokens already in cache."""

    start: int  # first row of this chunk in the step
    num_tokens: int
    num_cached: int
    block_table: torch.Tensor | None  # [n_blocks] long; None when num_cached == 0 (no gather needed)
    mask: torch.Tensor | None  # [num_tokens, num_cached + num_tokens] bool; None when num_cached == 0
    # sliding-window reads by (window, block size), built at the first sliding layer: ``window()``
    _windows: dict[tuple[int, int], PrefillWindow] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def window(self, window: int, block_size: int, device: torch.device) -> PrefillWindow:
        """What a ``window``-token sliding layer reads for this chunk: the blocks from the one holding its
        first query's oldest key (q - W < k <= q) and the mask over them. Built once per step."""
        key = (window, block_size)
        if key not in self._windows:
            self._windows[key] = self._cut(window, block_size, device)
        return self._windows[key]

    def _cut(self, window: int, block_size: int, dev: torch.device) -> PrefillWindow:
        c, n = self.num_cached, self.num_tokens
        if c + n <= window:  # every key is in every query's window: the causal read as it is
            return PrefillWindow(self.block_table, 0, self.mask)
        first = max(0, c - window + 1) // block_size  # the first block holding a key in the window
        start = first * block_size
        table = None if self.block_table is None else self.block_table[first:]
        q = torch.arange(c, c + n, device=dev)[:, None]  # [n, 1]
        k = torch.arange(start, c + n, device=dev)[None, :]  # [1, c + n - start]
        return PrefillWindow(table, start, (k <= q) & (k > q - window))


@dataclass(frozen=True)
class PrefillWindow:
    """A prefill chunk as a sliding layer reads it (``PrefillGroup.window``)."""

    block_table: torch.Tensor | None  # [n_blocks] long from the first block read; None: nothing cached
    start: int  # position of the first key read (block-aligned)
    mask: torch.Tensor | None  # [num_tokens, c + num_tokens - start] bool; None: the causal mask


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step in one KV group; built by the model runner, read by every
    layer of the group (a dense model: one for every layer)."""

    slot_block_ids: torch.Tensor  # [T] long: where each new token's K/V is written
    slot_offsets: torch.Tensor  # [T] long
    decode: DecodeGroup | None
    prefills: list[PrefillGroup]
    # (pool, [T] int64 byte offsets of the slots inside one layer of it): ``slot_bytes()``
    _slot_bytes: tuple[PagedKVCache, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def slot_bytes(self, kv_cache: PagedKVCache) -> torch.Tensor:
        """[T] int64: where each new token's K|V slot starts inside one layer slot of a plain pool's
        ``raw`` ([NB, S, BS, 2, KVH, D]), in bytes; counted once per step (and KV group) for every
        layer's cache write."""
        if self._slot_bytes is None or self._slot_bytes[0] is not kv_cache:
            raw, size = kv_cache.raw, kv_cache.raw.element_size()
            at = self.slot_block_ids * (raw.stride(0) * size) + self.slot_offsets * (raw.stride(2) * size)
            self._slot_bytes = (kv_cache, at.to(torch.long).contiguous())
        return self._slot_bytes[1]


def teacher_forced_chunk(start: int, end: int, block_size: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions ``[start, end)`` ([T] long) of one sequence laid out in blocks 0, 1, 2, ... of a fresh
    cache, and their metadata: a teacher-forced pass in chunks (benchmarks and tests); each chunk
    attends to everything before it."""
    pos = torch.arange(start, end)
    if start == 0:
        group = PrefillGroup(0, end, 0, None, None)
    else:
        mask = torch.arange(end)[None, :] <= pos[:, None]  # [chunk, end]
        group = PrefillGroup(0, end - start, start, torch.arange(-(-end // block_size)), mask)
    return pos, AttentionMetadata(pos // block_size, pos % block_size, None, [group])


def write_kv(
    kv_cache: PagedKVCache, layer: int, kv_new: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Store the step's new K/V (``kv_new``: [T, 2, KVH, D]) into their slots; returns them as a read
    of the cache would ([T, 2, KVH, D]: ``kv_new`` itself with ``auto``, else dequantized). Only a
    fresh prefill chunk (nothing cached) attends to these values; without one, ``kv_new`` comes back
    as it is (its shape is all attention reads), sparing a compact decode step the dequantize."""
    fresh = any(p.block_table is None for p in meta.prefills)
    lib = kvkernels.kernels() if kvkernels.stores(kv_cache) else None
    if lib is not None:  # compact on CPU: quantize and scatter in C
        return kvkernels.store_quantized(
            lib, kv_cache, layer, kv_new, meta.slot_block_ids, meta.slot_offsets, fresh
        )
    return kv_cache.write(layer, kv_new, meta.slot_block_ids, meta.slot_offsets, stored_values=fresh)


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (RoPE applied)
    kv_new: torch.Tensor,  # [T, 2, KVH, D] this step's K/V as stored (write_kv's result)
    kv_cache: PagedKVCache,  # raw [NB, S, BS, 2, KVH, D] (or its compact form)
    layer: int,  # the layer's slot in its KV group's blocks
    meta: AttentionMetadata,  # the layer's KV group's
    scale: float,
    kernel: bool | str = True,
    window: int | None = None,
) -> torch.Tensor:  # [T, H * D]
    """The step's attention: decode rows first, then each prefill chunk. Compact K/V is stored rotated
    (kv_quant.py): queries are rotated into that basis and outputs back, except by the fused decode
    kernel (kvkernels.py), which reads the pool in place and rotates inside. ``kernel`` (an attention
    backend, ``attention_backend.py``): True or "c", the C decode kernel where it covers the cache;
    False or "torch", the torch path for every row (the model's torch ops: benchmarks compare the two);
    "triton", the Triton kernels for every row. ``window``: a sliding-window layer's W (None: full
    attention)."""
    if kernel == TRITON:
        return _triton_attention(q, kv_new, kv_cache, layer, meta, scale, window)
    head_dim = q.shape[2]
    d = meta.decode
    cut = window is not None and d is not None and d.window(window, kv_cache.block_size) is not None
    c_kernel = kernel is True or kernel == C
    lib = _decode_kernel(kv_cache, q.shape[1]) if d is not None and c_kernel and not cut else None
    if lib is None:  # the torch path for every row
        rotated = kv_cache.rotate_queries(q)
        out = _attend(rotated, kv_new, kv_cache, layer, meta, scale, with_decode=True, window=window)
        return kv_cache.unrotate_output(out, head_dim)
    assert d is not None
    out = kvkernels.decode_attention(d.kernel_call(lib, kv_cache, q.shape[1], scale), q[: d.num_seqs], layer)
    if not meta.prefills:
        return out  # [B, H * D]
    rotated = kv_cache.rotate_queries(q)
    rest = _attend(rotated, kv_new, kv_cache, layer, meta, scale, with_decode=False, window=window)
    return torch.cat([out, kv_cache.unrotate_output(rest, head_dim)], dim=0)


def _triton_attention(
    q: torch.Tensor,  # [T, H, D] (RoPE applied)
    kv_new: torch.Tensor,  # [T, 2, KVH, D] as stored
    kv_cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [T, H * D]
    """Every row through the Triton kernels (``triton_attention.py``, imported at the first call): the
    decode group in one launch over its block tables, each prefill chunk in one over its own."""
    from kvtier.models import triton_attention

    rotated = kv_cache.rotate_queries(q)  # [T, H, D] in the stored K/V's basis
    outs: list[torch.Tensor] = []
    d = meta.decode
    if d is not None:
        b = d.num_seqs
        lens = d.context_lens()  # [B] long; None: every row has max_context tokens
        if lens is None:
            lens = torch.full((b,), d.max_context, dtype=torch.long, device=q.device)
        tables = d.block_tables.view(b, d.max_blocks)  # [B, max_blocks]
        outs.append(
            triton_attention.decode(rotated[:b], kv_cache, layer, tables, lens, d.max_context, scale, window)
        )
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        chunk = (kv_cache, layer, p.block_table, p.num_cached, scale, window)
        outs.append(triton_attention.prefill(rotated[rows], kv_new[rows], *chunk))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return kv_cache.unrotate_output(out, q.shape[2])


def _decode_kernel(kv_cache: PagedKVCache, num_heads: int) -> ctypes.CDLL | None:
    """The fused decode kernel library when it covers this cache (fp32 compute on CPU), else None."""
    if not kvkernels.supports(kv_cache, num_heads):
        return None
    return kvkernels.kernels()


def _attend(
    q: torch.Tensor,  # [T, H, D] in the stored K/V's basis
    kv_new: torch.Tensor,  # [T, 2, KVH, D]
    kv_cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    with_decode: bool,
    window: int | None = None,
) -> torch.Tensor:  # [T, H * D] (without the decode rows unless ``with_decode``), the stored basis
    """Attention of the decode group (when ``with_decode``) and every prefill chunk, through torch."""
    outs: list[torch.Tensor] = []
    if meta.decode is not None and with_decode:
        outs.append(_decode_torch(q, kv_cache, layer, meta.decode, scale, window))
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // kv_new.shape[2]
    for p in meta.prefills:
        # CPU SDPA's fused kernel wants 4-D inputs: 3-D ones fall back to unfused math (~6x slower)
        qs = q[p.start : p.start + p.num_tokens].transpose(0, 1)[None]  # [1, H, n, D]
        kv, mask = _prefill_keys(kv_new, kv_cache, layer, p, window)  # [ctx, 2, KVH, D], [n, ctx] | None
        k = kv[:, 0].transpose(0, 1)[None]  # [1, KVH, ctx, D]
        v = kv[:, 1].transpose(0, 1)[None]
        o = sdpa(
            qs, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )  # [1, H, n, D]
        outs.append(o[0].transpose(0, 1).reshape(p.num_tokens, num_heads * head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


# cuDNN's SDPA builds a graph for each new shape: 43-67 ms a shape on an H200 (2026-11-28, batches 1-64,
# later calls of a shape 0.1-1.6 ms), and a decode's or a chunk's shape changes every step as contexts
# grow, so the torch path on CUDA leaves it out (its eager decode steps were 55-88 ms with it, 5-17 without).
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, without cuDNN's backend on CUDA (above)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]
    with sdpa_kernel(_NOT_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]


def _prefill_keys(
    kv_new: torch.Tensor,  # [T, 2, KVH, D]
    kv_cache: PagedKVCache,
    layer: int,
    p: PrefillGroup,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # K/V [ctx, 2, KVH, D], mask [n, ctx] (None: causal)
    """The keys and values a chunk attends to, and their mask: a fresh prompt's own K/V (nothing to
    gather), or its cached context gathered through the block table (from the window's first block
    for a sliding layer)."""
    table, start, mask = p.block_table, 0, p.mask
    if window is not None:
        w = p.window(window, kv_cache.block_size, kv_new.device)
        table, start, mask = w.block_table, w.start, w.mask
    if table is None:
        return kv_new[p.start : p.start + p.num_tokens], mask  # fresh prompt: nothing to gather
    return kv_cache.gather(layer, table)[: p.num_cached + p.num_tokens - start], mask


def _decode_torch(
    q: torch.Tensor,  # [T, H, D] in the stored K/V's basis (rows [0, B) are the decode group's)
    kv_cache: PagedKVCache,
    layer: int,
    d: DecodeGroup,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [B, H * D]
    """The decode group through torch: gather the context, SDPA (or the scaled form when compact). A
    sliding layer whose window cuts the context reads the group's window rows (``DecodeGroup.window``)."""
    b, num_heads, head_dim = d.num_seqs, q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.token_shape[1]
    qd = q[:b].view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)  # heads sharing a KV head as rows
    cut = None if window is None else d.window(window, kv_cache.block_size)
    tables, num_blocks, mask = (
        (d.block_tables, d.max_blocks, d.mask)
        if cut is None
        else (cut.block_tables, cut.num_blocks, cut.mask)
    )
    context = d.max_context if cut is None else num_blocks * kv_cache.block_size
    ctx_shape = (b, num_blocks * kv_cache.block_size, 2, num_kv_heads, head_dim)
    ctx, ctx_scale = kv_cache.gather_unscaled(layer, tables, reuse=True)  # used before the next
    ctx = ctx.view(ctx_shape)[:, :context]  # [B, ctx, 2, KVH, D]
    if ctx_scale is None:
        k = ctx[:, :, 0].transpose(1, 2)  # [B, KVH, ctx, D]
        v = ctx[:, :, 1].transpose(1, 2)
        o = sdpa(qd, k, v, attn_mask=mask, scale=scale)  # [B, KVH, G, D]
    else:
        ctx_scale = ctx_scale.view(ctx_shape[:-1])[:, :context]  # [B, ctx, 2, KVH]
        o = decode_attention_scaled(qd, ctx, ctx_scale, mask, scale)
    return o.reshape(b, num_heads * head_dim)


def decode_attention_scaled(
    qd: torch.Tensor,  # [B, KVH, G, D] one query token per sequence, its G heads per KV head as rows
    ctx: torch.Tensor,  # [B, ctx, 2, KVH, D] stored compact K/V elements, before their scales
    ctx_scale: torch.Tensor,  # [B, ctx, 2, KVH] float32: one scale per token, K or V, KV head
    mask: torch.Tensor | None,  # [B, 1, 1, ctx] bool (True = attend)
    scale: float,
) -> torch.Tensor:  # [B, KVH, G, D]
    """Decode attention over compact K/V without dequantizing it: q.(s k) = s (q.k) and
    sum_t p_t (s_t v_t) = sum_t (p_t s_t) v_t, so a token's scale multiplies its G scores and G
    probabilities (per KV head) instead of its 2 x D stored values: one pass over the context less."""
    k = ctx[:, :, 0].permute(0, 2, 3, 1)  # [B, KVH, D, ctx]
    v = ctx[:, :, 1].transpose(1, 2)  # [B, KVH, ctx, D]
    s = ctx_scale.to(qd.dtype).permute(0, 2, 3, 1).unsqueeze(3)  # [B, 2, KVH, 1, ctx]
    scores = torch.matmul(qd, k).mul_(s[:, 0] * scale)  # [B, KVH, G, ctx]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).mul_(s[:, 1])  # [B, KVH, G, ctx]
    return torch.matmul(probs, v)
