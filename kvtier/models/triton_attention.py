"""Paged attention in Triton: decode and prefill kernels that read K/V through the block tables.

Imported only when the ``triton`` attention backend is chosen (``attention_backend.py``): nothing else in
kvtier imports triton. On CUDA the kernels compile; on a CPU they run through Triton's interpreter when
``TRITON_INTERPRET=1`` is set before this module is imported (numpy, slow: tests and checks only).

The pool is ``PagedKVCache`` (``kv_quant.py``); a layer's view of it is read in place::

    plain (float32 / bfloat16 / float16):  data   [NB, BS, 2, KVH, D]  (raw[:, layer])
    compact (fp8_e4m3 / fp8_e5m2 / int8):  data   [NB, BS, 2, KVH, D]  one byte each (read as int8)
                                           scales [NB, BS, 2, KVH]     float32, after the data in the row
    token at position p of a sequence:     block table[p // BS], row p % BS

A stored element becomes its value as ``kv_quant.to_compute`` makes it, bit for bit: int8 converts,
e5m2's byte is the top byte of a float16, e4m3's exponent and mantissa are put in bits 13..7 of a float16
of value / 2^8 (subnormals included; the 2^8 multiplied back, exactly); the sign is applied after. Each
token's scale multiplies its score and its probability (``attention.decode_attention_scaled``: one
multiply per token instead of per element; the product is the dequantized K/V's). Queries arrive in the
stored basis (``PagedKVCache.rotate_queries``), outputs leave in it.

Decode: one program per (sequence, KV head, part of the context), its G query heads as the rows of one
tile, so K/V are read once per KV head (GQA without repeating them). A sequence of n tokens attends to
positions ``lo <= k < n``, ``lo = max(0, n - W)`` for a sliding layer (q - W < k <= q, q = n - 1). With
several parts (split-K, flash-decoding) each part keeps its max, sum and unnormalized output and
``_merge_parts`` merges them::

    context  lo ............................. n
    parts    | part 0 | part 1 | part 2 |          per part: m_s, l_s, acc_s   [G, D]
    out      sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s,     M = max_s m_s

Prefill: one program per (tile of a chunk's query tokens, KV head, part of the keys); its rows are
(token, query head of the KV head) pairs, so the tile reads K/V once for its G heads. A chunk of n tokens
after c cached attends causally (with the window) to the cache through its block table, its own tokens
included (they are written before attention), or, with nothing cached, to its own K/V as stored
(``kv_new``). A long chunk has tiles enough to fill the GPU (one part); a short one after a long
context (a prefix hit's last block: 16 tokens after 8,176) would have 8 programs walk 8k keys each, so
its keys are split and merged like a decode's (on an H200 that chunk's attention took 5.7 ms, 16 layers).

The part counts are runtime arguments, not compile-time constants: a growing context never compiles a
new kernel (each kernel compiles twice at most: one part, and several).

Every score and sum is float32 (``tl.dot`` in IEEE fp32 for float32 queries; with bfloat16/float16
queries in TF32, which holds their values and the fp8/int8 elements exactly); the output is the query's
dtype. The torch path (``attention.py``) is the reference: ``tests/test_triton_attention.py`` compares.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvtier.models.kv_quant import PagedKVCache

# How a pool stores elements (the kernels' FMT): plain float, or compact with per-token scales.
PLAIN, INT8, E4M3, E5M2 = 0, 1, 2, 3
_FORMATS = {"int8": INT8, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
_E4M3 = tl.constexpr(E4M3)
_E5M2 = tl.constexpr(E5M2)
_PLAIN = tl.constexpr(PLAIN)
_NEG = tl.constexpr(-1.0e30)  # a running max's start: finite, so a fully masked tile keeps exp() at 0
MIN_SPLIT_TOKENS = 256  # the fewest context tokens a decode part takes
MAX_SPLITS = 16
# Tests only: the window's first key moved by this many tokens in both kernels, a deliberately broken
# variant that the comparison with the torch path must catch (tests/test_triton_attention.py).
_TEST_WINDOW_SKEW = 0


@triton.jit
def _to_float(x, FMT: tl.constexpr):
    """Stored elements -> float32 values before their scale (``kv_quant.to_compute``, bit for bit)."""
    if FMT == _E4M3:
        u = x.to(tl.int32) & 0xFF
        mag = ((u & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        out = tl.where((u & 0x80) != 0, -mag, mag)
    elif FMT == _E5M2:
        u = x.to(tl.int32) & 0xFF
        mag = ((u & 0x7F) << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        out = tl.where((u & 0x80) != 0, -mag, mag)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def _tile(
    data_ptr, scale_ptr, table_ptr,  # the source: a layer of the pool (PAGED) or dense [n, 2, KVH, D] rows
    pos, valid, kv, head, offs_d,  # [T] positions, [T] which are read, 0 = K / 1 = V, KV head, [BD]
    sb, st, skv, sh, cb, ct, ckv,  # element strides: block, token, K|V, head; scales: block, token, K|V
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, FMT: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    """A tile of K or V: ([T, BD] float32 values before their scales, [T] float32 scales; 0 where not
    read). PAGED: position p is row p % BS of block table[p // BS]; else row p of the dense rows."""
    if PAGED:
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        row = block * sb + slot * st
        if FMT == _PLAIN:
            sc = tl.where(valid, 1.0, 0.0)
        else:
            sc = tl.load(scale_ptr + block * cb + slot * ct + kv * ckv + head, mask=valid, other=0.0)
    else:
        row = pos.to(tl.int64) * st
        sc = tl.where(valid, 1.0, 0.0)
    ptrs = data_ptr + (row + kv * skv + head * sh)[:, None] + offs_d[None, :]
    x = tl.load(ptrs, mask=valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0)
    return _to_float(x, FMT), sc


@triton.jit
def _attend(
    q, qpos, lo, hi, window, skew, sm_scale,  # [R, BD] float32 rows, [R] their positions, keys [lo, hi)
    data_ptr, scale_ptr, table_ptr, head, sb, st, skv, sh, cb, ct, ckv,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FMT: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax of the rows of ``q`` over the keys at positions [lo, hi) that each row sees:
    k <= its position, and k > position - window (a sliding layer; window 0: none). Returns the
    unnormalized output [R, BD], the running max [R] and the sum [R]."""
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.zeros([q.shape[0]], tl.float32) + _NEG
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros([q.shape[0], BLOCK_D], tl.float32)
    oldest = tl.where(window > 0, qpos - window + skew, -1)  # [R] each row's newest unseen position
    for t0 in range(lo, hi, BLOCK_T):
        pos = t0 + tl.arange(0, BLOCK_T)
        valid = pos < hi
        k, sk = _tile(
            data_ptr, scale_ptr, table_ptr, pos, valid, 0, head, offs_d, sb, st, skv, sh, cb, ct, ckv,
            HEAD_DIM, BLOCK_SIZE, FMT, PAGED,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (sk * sm_scale)[None, :]  # [R, T]
        sees = valid[None, :] & (pos[None, :] <= qpos[:, None]) & (pos[None, :] > oldest[:, None])
        s = tl.where(sees, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [R, T]
        l_i = l_i * alpha + tl.sum(p, 1)
        v, sv = _tile(
            data_ptr, scale_ptr, table_ptr, pos, valid, 1, head, offs_d, sb, st, skv, sh, cb, ct, ckv,
            HEAD_DIM, BLOCK_SIZE, FMT, PAGED,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p * sv[None, :], v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["splits", "s_tab", "window"])  # one compile as contexts grow
def _decode_kernel(
    q_ptr, sq_b, sq_h,  # [B, H, D] queries (stored basis)
    out_ptr, so_b, so_h,  # [B, H, D] output (one part)
    part_ptr, ml_ptr,  # [B, H, splits, D], [B, H, splits, 2] float32: each part's acc and (max, sum)
    data_ptr, sb, st, skv, sh,  # the layer's pool [NB, BS, 2, KVH, D]
    scale_ptr, cb, ct, ckv,  # its scales [NB, BS, 2, KVH] (compact)
    tables_ptr, s_tab, lens_ptr,  # [B, max_blocks] int64 block tables, [B] int64 context lengths
    window, skew, sm_scale, splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr, FMT: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (b, h, s): part s of ``splits`` of sequence b's context for the G query heads of KV head
    h (SPLIT: more than one part, written for ``_merge_parts``; else the output itself)."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens_ptr + b).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(n - window + skew, 0), 0)
    per = tl.cdiv(tl.cdiv(n - lo, splits), BLOCK_T) * BLOCK_T  # tokens per part, whole tiles
    start = lo + s * per
    stop = tl.minimum(start + per, n)
    offs_g, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads = h * G + offs_g  # [BLOCK_G] query heads (rows past G are padding)
    row_ok = (offs_g < G)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_ptrs = q_ptr + b.to(tl.int64) * sq_b + heads[:, None] * sq_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    qpos = tl.zeros([BLOCK_G], tl.int32) + (n - 1)
    table_ptr = tables_ptr + b.to(tl.int64) * s_tab  # sequence b's row
    acc, m_i, l_i = _attend(
        q, qpos, start, stop, window, skew, sm_scale, data_ptr, scale_ptr, table_ptr,
        h, sb, st, skv, sh, cb, ct, ckv, HEAD_DIM, BLOCK_D, BLOCK_T, BLOCK_SIZE, FMT, True, PRECISION,
    )  # fmt: skip
    rows = offs_g * 0 + b  # [BLOCK_G] every row is sequence b's
    _finish(acc, m_i, l_i, rows, heads, offs_g < G, row_ok, s, splits, out_ptr, so_b, so_h, part_ptr, ml_ptr,
            tl.num_programs(1) * G, HEAD_DIM, BLOCK_D, SPLIT)  # fmt: skip


@triton.jit
def _finish(
    acc, m_i, l_i, row, heads, head_ok, ok, s, splits,  # [R, BD], [R], [R]; each row's output row, head
    out_ptr, so_r, so_h, part_ptr, ml_ptr, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """One part's rows: normalized into the output, or (SPLIT) kept for ``_merge_parts`` as
    part[row, head, s] = acc and ml[row, head, s] = (max, sum)."""
    offs_d = tl.arange(0, BLOCK_D)
    if SPLIT:
        item = (row.to(tl.int64) * num_heads + heads) * splits + s  # [R]
        tl.store(part_ptr + item[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=ok)
        tl.store(ml_ptr + item * 2, m_i, mask=head_ok)
        tl.store(ml_ptr + item * 2 + 1, l_i, mask=head_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + row.to(tl.int64)[:, None] * so_r + heads[:, None] * so_h + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["splits"])
def _merge_parts(
    part_ptr, ml_ptr, out_ptr, so_b, so_h, splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (row, query head): the ``splits`` parts of one row merged by their max and sum
    (flash-decoding); a row is a decode sequence or a prefill chunk's token."""
    b, hq = tl.program_id(0), tl.program_id(1)
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    item = (b.to(tl.int64) * tl.num_programs(1) + hq) * splits + offs_s  # [BLOCK_S]
    s_ok = offs_s < splits
    m = tl.load(ml_ptr + item * 2, mask=s_ok, other=_NEG)
    l_s = tl.load(ml_ptr + item * 2 + 1, mask=s_ok, other=0.0)
    ok = s_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc = tl.load(part_ptr + item[:, None] * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # [BLOCK_S]
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    o_ptrs = out_ptr + b.to(tl.int64) * so_b + hq * so_h + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_tokens", "num_cached", "splits"])  # one compile for every chunk size
def _prefill_kernel(
    q_ptr, sq_t, sq_h,  # the chunk's [n, H, D] queries (stored basis)
    out_ptr, so_t, so_h,  # its [n, H, D] output
    part_ptr, ml_ptr,  # SPLIT: [n, H, splits, D], [n, H, splits, 2] float32, each part's acc, (max, sum)
    data_ptr, sb, st, skv, sh,  # PAGED: the layer's pool [NB, BS, 2, KVH, D]; else the chunk's [n, 2, KVH, D]
    scale_ptr, cb, ct, ckv, table_ptr,  # scales [NB, BS, 2, KVH] (compact), [n_blocks] int64 block table
    num_tokens, num_cached, window, skew, sm_scale, splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr, FMT: tl.constexpr,
    PAGED: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (m, h, s): query tokens [m * BLOCK_M, (m + 1) * BLOCK_M) of the chunk, for the G query
    heads of KV head h, over part s of ``splits`` of the keys the tile sees; row r is token r // BLOCK_G,
    head h * G + r % BLOCK_G."""
    mt, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    tok, g = mt * BLOCK_M + rows // BLOCK_G, rows % BLOCK_G
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = (tok < num_tokens) & (g < G)
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    head = h * G + g
    q_ptrs = q_ptr + tok.to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=ok, other=0.0).to(tl.float32)
    qpos = num_cached + tok  # [R]
    first = num_cached + mt * BLOCK_M  # the tile's first and last query positions
    last = num_cached + tl.minimum(mt * BLOCK_M + BLOCK_M, num_tokens) - 1
    lo = tl.where(window > 0, tl.maximum(first - window + 1 + skew, 0), 0)
    per = tl.cdiv(tl.cdiv(last + 1 - lo, splits), BLOCK_T) * BLOCK_T  # keys per part, whole tiles
    start = lo + s * per
    acc, m_i, l_i = _attend(
        q, qpos, start, tl.minimum(start + per, last + 1), window, skew, sm_scale, data_ptr, scale_ptr,
        table_ptr, h, sb, st, skv, sh, cb, ct, ckv, HEAD_DIM, BLOCK_D, BLOCK_T, BLOCK_SIZE, FMT, PAGED,
        PRECISION,
    )  # fmt: skip
    _finish(acc, m_i, l_i, tok, head, row_ok, ok, s, splits, out_ptr, so_t, so_h, part_ptr, ml_ptr,
            tl.num_programs(1) * G, HEAD_DIM, BLOCK_D, SPLIT)  # fmt: skip


# ------------------------------------------------------------------------------------------ host side


def _layer_pool(kv_cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(data [NB, BS, 2, KVH, D], scales [NB, BS, 2, KVH] float32 or data again, FMT) of one layer slot."""
    if kv_cache.scales is None:
        data = kv_cache.raw.select(1, layer)
        return data, data, PLAIN
    data = kv_cache.data.select(1, layer).view(torch.int8)  # one byte each, converted in the kernel
    return data, kv_cache.scales.select(1, layer), _FORMATS[kv_cache.fmt.name]


def _precision(q: torch.Tensor) -> str:
    """IEEE fp32 dots for float32 queries (the torch path's precision); TF32 holds bf16/fp16 exactly."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _tiles(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_T key tile, num_warps): smaller key tiles for wide heads."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return block_d, (64 if block_d <= 64 else 32), (4 if block_d <= 128 else 8)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_splits(num_programs: int, max_tokens: int, device: torch.device) -> int:
    """Parts of the context per program (split-K): enough programs for about two per SM on a GPU, each
    part at least ``MIN_SPLIT_TOKENS`` long; 1 elsewhere (the interpreter runs programs one after
    another). ``num_programs``: the launch's programs without splitting (a decode: sequences x KV heads;
    a prefill: query tiles x KV heads)."""
    want = -(-2 * _num_sms(device) // num_programs)
    return max(1, min(want, -(-max_tokens // MIN_SPLIT_TOKENS), MAX_SPLITS))


def _parts(rows: int, num_heads: int, splits: int, head_dim: int, device: torch.device) -> tuple:
    """(part [rows, H, splits, D], ml [rows, H, splits, 2]) float32 for the parts of a split launch
    (1-element stand-ins when there is one part: the kernel writes the output itself)."""
    if splits == 1:
        one = torch.empty(1, device=device)
        return one, one
    part = torch.empty(rows, num_heads, splits, head_dim, device=device)
    return part, torch.empty(rows, num_heads, splits, 2, device=device)


def _merge(part: torch.Tensor, ml: torch.Tensor, out: torch.Tensor, splits: int, block_d: int) -> None:
    """``_merge_parts`` over every (row, query head) of ``out`` [rows, H, D]."""
    rows, num_heads, head_dim = out.shape
    assert splits <= MAX_SPLITS, f"{splits} parts: at most {MAX_SPLITS} merge"
    _merge_parts[(rows, num_heads)](
        part, ml, out, out.stride(0), out.stride(1), splits,
        BLOCK_S=triton.next_power_of_2(MAX_SPLITS), HEAD_DIM=head_dim, BLOCK_D=block_d,
    )  # fmt: skip


def decode(
    q: torch.Tensor,  # [B, H, D] one query token per sequence, in the stored K/V's basis
    kv_cache: PagedKVCache,
    layer: int,  # the layer's slot in its KV group's blocks
    block_tables: torch.Tensor,  # [B, max_blocks] long
    context_lens: torch.Tensor,  # [B] long: tokens per sequence, the new one included
    max_context: int,
    scale: float,
    window: int | None = None,
    splits: int | None = None,  # parts per sequence (None: ``num_splits``)
) -> torch.Tensor:  # [B, H * D] in q's dtype
    """Decode attention of ``B`` sequences over the pool, read through their block tables."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.token_shape[1]
    group = num_heads // num_kv_heads
    span = max_context if window is None else min(window, max_context)
    splits = splits or num_splits(b * num_kv_heads, span, q.device)
    out = torch.empty(b, num_heads, head_dim, dtype=q.dtype, device=q.device)
    part, ml = _parts(b, num_heads, splits, head_dim, q.device)
    data, scales, fmt = _layer_pool(kv_cache, layer)
    tables, lens = block_tables.to(torch.long), context_lens.to(device=q.device, dtype=torch.long)
    block_d, block_t, warps = _tiles(head_dim)
    _decode_kernel[(b, num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), part, ml,
        data, data.stride(0), data.stride(1), data.stride(2), data.stride(3),
        scales, scales.stride(0), scales.stride(1), scales.stride(2),
        tables, tables.stride(0), lens, window or 0, _TEST_WINDOW_SKEW, scale, splits,
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_T=block_t, BLOCK_SIZE=kv_cache.block_size, FMT=fmt, SPLIT=splits > 1, PRECISION=_precision(q),
        num_warps=warps,
    )  # fmt: skip
    if splits > 1:
        _merge(part, ml, out, splits, block_d)
    return out.view(b, num_heads * head_dim)


def prefill(
    q: torch.Tensor,  # [n, H, D] the chunk's queries, in the stored K/V's basis
    kv_new: torch.Tensor,  # [n, 2, KVH, D] the chunk's K/V as stored (read when nothing is cached)
    kv_cache: PagedKVCache,
    layer: int,
    block_table: torch.Tensor | None,  # [n_blocks] long covering positions [0, num_cached + n); None: fresh
    num_cached: int,
    scale: float,
    window: int | None = None,
    splits: int | None = None,  # parts of the keys per query tile (None: ``num_splits``)
) -> torch.Tensor:  # [n, H * D] in q's dtype
    """Causal attention of a chunk of ``n`` tokens after ``num_cached`` cached ones (the cache read
    through ``block_table``, own tokens included; with nothing cached, its own ``kv_new``). A short
    chunk after a long context (a prefix hit's last block) splits the keys like a decode."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.token_shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    paged = block_table is not None
    if paged:
        data, scales, fmt = _layer_pool(kv_cache, layer)
        table, strides, scale_strides = block_table.to(torch.long), data.stride()[:4], scales.stride()[:3]
    else:  # the chunk's own rows, already values (dequantized as stored): row p is position p
        data = scales = table = kv_new
        fmt, strides, scale_strides = PLAIN, (0, *kv_new.stride()[:3]), (0, 0, 0)
    block_d, block_t, warps = _tiles(head_dim)
    block_g = triton.next_power_of_2(group)
    block_m = max(1, (64 if block_d <= 128 else 32) // block_g)
    tiles = triton.cdiv(n, block_m)
    span = num_cached + n if window is None else min(window + block_m, num_cached + n)
    splits = splits or num_splits(tiles * num_kv_heads, span, q.device)
    part, ml = _parts(n, num_heads, splits, head_dim, q.device)
    _prefill_kernel[(tiles, num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), part, ml,
        data, *strides, scales, *scale_strides, table, n, num_cached, window or 0, _TEST_WINDOW_SKEW, scale,
        splits, G=group, BLOCK_G=block_g, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_T=block_t, BLOCK_SIZE=kv_cache.block_size, FMT=fmt, PAGED=paged, SPLIT=splits > 1,
        PRECISION=_precision(q), num_warps=warps,
    )  # fmt: skip
    if splits > 1:
        _merge(part, ml, out, splits, block_d)
    return out.view(n, num_heads * head_dim)


def compiled_kernels() -> int:
    """The kernel variants Triton compiled in this process so far (on CUDA each is a compile and a ptxas
    run, a second or more; the interpreter compiles none; -1: this Triton's caches are laid out
    otherwise): ``kvtier bench gpu`` reports it per exactness run, so a compile storm shows."""
    total = 0
    for fn in (_decode_kernel, _merge_parts, _prefill_kernel):
        for entry in getattr(fn, "device_caches", {}).values():
            try:
                total += len(entry[0])  # (kernel cache, ...): the rest differs between versions
            except (TypeError, IndexError, KeyError):
                return -1  # a Triton whose caches look otherwise: unknown
    return total
