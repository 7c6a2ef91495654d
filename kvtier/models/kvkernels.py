"""The decode attention kernel (``kvattn.c``): built like the weight kernels, loaded with ctypes.

``decode_attention`` runs a decode group's attention for one layer straight over the pool of a
``PagedKVCache`` (compact fp8_e4m3, fp8_e5m2, int8; plain float32 and bfloat16, whose rows have no
scales and no rotation, the same walk): per sequence and KV head, scores over the stored K
through the block table, softmax, and the weighted sum of the stored V, each token's scale applied to
its score and probability, with the Walsh-Hadamard rotation of the stored K/V applied to the queries
and undone on the output inside the kernel. One call per layer replaces the gather, the fp8/int8
conversion, the two matmuls, the softmax, the scale products and the two rotations of the torch path
(``attention.decode_attention_scaled``), which stays the fallback: where the kernel cannot be built
(no gcc, a CPU without AVX2/FMA/F16C, ``KVTIER_NO_KERNELS`` set), or for a cache it does not cover
(``supports``). Both paths compute the same sums; they agree to fp32 rounding (summation order, and the
kernel's polynomial exp), pinned by ``tests/test_kv_decode_kernel.py``.

The library is ``<kvtier cache>/kernels/kvattn-<source hash>.so``, built by ``qkernels.build`` under
its lock (``make setup`` builds it too).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

from kvtier.models.kv_quant import PagedKVCache, scale_steps
from kvtier.models.qkernels import library_path, load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kvattn.c")
# kvattn.c's KV_INT8, KV_E4M3, KV_E5M2, KV_F32, KV_BF16
FORMAT_IDS = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3, "float32": 4, "bfloat16": 5}
MAX_GROUP = 8  # query heads per KV head the kernel is specialized for
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64
# Sequences x KV heads x context tokens from which a call forks OpenMP threads (each sequence's
# context split in parts of >= PART_TOKENS; $KVTIER_KV_KERNEL_PARALLEL_MIN sets it). The kernel's
# libgomp is torch's (one runtime, one pool in the process). On the quiet 2-core machine, in one
# process against the torch path, a 4k-context decode step went from 0.91x (serial) to 1.3-1.6x with
# float32 KV (`auto`) and from 1.06x to 1.4-2.0x with `gguf` weights (BENCHMARKS.md). It was off by
# default before: on the loaded machine (load average 7-8) forking made a 4k int8 step 1.5x slower.
PARALLEL_MIN = int(os.environ.get("KVTIER_KV_KERNEL_PARALLEL_MIN", 3 * 512))
PART_TOKENS = 256  # the smallest context part a thread takes
_state: dict[str, ctypes.CDLL | None] = {}
_scratch = threading.local()


def kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, building it first when needed; None (logged once) when unavailable."""
    if "lib" in _state:
        return _state["lib"]
    lib = None
    try:
        lib = load_library(SOURCE)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.kv_decode_attention.argtypes = [i32, p, i64, i64, p, i64, p, i64, p, i64, p, p]
        lib.kv_decode_attention.argtypes += [i64, i64, i64, i64, i64, ctypes.c_float, i64, p, i32]
        lib.kv_decode_attention.restype = None
        # fmt, y, ldy, T, H2, D, rot, steps, S, factor, layer, block_stride, data_bytes, ids, offsets,
        # stored
        lib.kv_store_quantized.argtypes = [i32, p, i64, i64, i64, i64, p, p, i64, ctypes.c_float]
        lib.kv_store_quantized.argtypes += [p, i64, i64, p, p, p]
        lib.kv_store_quantized.restype = None
        lib.kv_fp8_codes.argtypes, lib.kv_fp8_codes.restype = [i32, p, i64, p], None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("kvtier: compact-KV decode kernel unavailable (%s); using the torch path", exc)
        lib = None
    _state["lib"] = lib
    return lib


def supports(kv_cache: PagedKVCache, num_heads: int) -> bool:
    """Whether the kernel covers this cache: fp8/int8/float32/bfloat16 KV on CPU, float32 compute, a
    head_dim that is a multiple of 64 up to 256, blocks of at most 64 tokens, at most 8 query heads per
    KV head."""
    fmt = kv_cache.fmt
    if fmt.name not in FORMAT_IDS or fmt.compute != torch.float32 or kv_cache.raw.device.type != "cpu":
        return False
    _, num_kv_heads, head_dim = kv_cache.token_shape
    group = num_heads // num_kv_heads
    shape_ok = head_dim % 64 == 0 and head_dim <= MAX_HEAD_DIM and kv_cache.block_size <= MAX_BLOCK_SIZE
    return shape_ok and 1 <= group <= MAX_GROUP


def _buffer(numel: int) -> torch.Tensor:
    """A per-thread float32 scratch buffer of at least ``numel`` elements (grown, never shrunk)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def _plan(num_seqs: int, num_kv_heads: int, max_context: int) -> tuple[int, int]:
    """(threads, parts per sequence): one thread and one part for small calls; else torch's threads,
    each context split so that every thread gets about two parts of >= PART_TOKENS tokens."""
    threads = torch.get_num_threads()
    if threads < 2 or num_seqs * num_kv_heads * max_context < PARALLEL_MIN:
        return 1, 1
    parts = max(1, min(-(-2 * threads // num_seqs), max_context // PART_TOKENS))
    return threads, parts


class StepCall:
    """The kernel call of one decode group over one cache, its per-step arguments converted once (at
    the step's first layer): block tables, lengths, thread plan, scratch, strides. A layer then adds
    only its pool offset, queries and output: ~10 us of ctypes work per layer instead of ~30 (x 30
    layers of a ~15 ms gguf decode step)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        kv_cache: PagedKVCache,  # raw uint8 [NB, S, layer_bytes] (compact) or [NB, S, BS, 2, KVH, D]
        num_heads: int,
        block_tables: torch.Tensor,  # [B * max_blocks] long
        context_lens: torch.Tensor | None,  # [B] long; None: every sequence has max_context tokens
        num_seqs: int,
        max_context: int,
        scale: float,
    ) -> None:
        _, num_kv_heads, head_dim = kv_cache.token_shape
        group = num_heads // num_kv_heads
        raw, esize = kv_cache.raw, kv_cache.raw.element_size()
        # the kernel reads raw int64 block ids and lengths: anything else would be misread
        self.tables = block_tables.to(torch.long).contiguous()
        self.lens = None if context_lens is None else context_lens.to(torch.long).contiguous()
        threads, parts = _plan(num_seqs, num_kv_heads, max_context)
        self.scratch = _buffer(
            num_seqs * num_kv_heads * (group * head_dim + parts * (group * head_dim + 2 * group))
        )
        self.fn, self.cache, self.layer_bytes = lib.kv_decode_attention, kv_cache, raw.stride(1) * esize
        data_bytes = kv_cache.data_bytes if kv_cache.scales is not None else raw[0, 0].numel() * esize
        rot = kv_cache.rotation
        self.pool_args = (
            raw.stride(0) * esize,
            data_bytes,
            self.tables.data_ptr(),
            self.tables.shape[0] // num_seqs,
        )
        self.pool_args += (None if self.lens is None else self.lens.data_ptr(), max_context)
        self.rot_ptr = None if rot is None else rot.data_ptr()
        self.shape_args = (num_seqs, kv_cache.block_size, num_kv_heads, group, head_dim, scale, parts)
        self.threads, self.format_id, self.num_seqs = threads, FORMAT_IDS[kv_cache.fmt.name], num_seqs

    def run(
        self,
        q: torch.Tensor,
        layer: int,  # [B, H, D] float32, the model's basis (not rotated)
    ) -> torch.Tensor:  # [B, H * D] float32, the model's basis
        """Read in place when each sequence's heads are contiguous (a view into the fused QKV rows)."""
        b, num_heads, head_dim = q.shape
        assert b == self.num_seqs
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        out = torch.empty(b, num_heads * head_dim, dtype=torch.float32)
        layer_ptr = self.cache.raw.data_ptr() + layer * self.layer_bytes
        self.fn(
            self.format_id, layer_ptr, *self.pool_args, q.data_ptr(), q.stride(0), self.rot_ptr,
            out.data_ptr(), *self.shape_args, self.scratch.data_ptr(), self.threads,
        )  # fmt: skip
        return out


def stores(kv_cache: PagedKVCache) -> bool:
    """Whether ``store_quantized`` covers this cache's writes: compact (fp8/int8) or bfloat16 on CPU,
    float32 compute (a bfloat16 row is rounded as torch's conversion rounds it, bit for bit)."""
    fmt = kv_cache.fmt
    covered = fmt.quantized or fmt.name == "bfloat16"
    return covered and fmt.compute == torch.float32 and kv_cache.raw.device.type == "cpu"


def store_quantized(
    lib: ctypes.CDLL,
    kv_cache: PagedKVCache,  # compact: raw uint8 [NB, S, layer_bytes]; bfloat16 [NB, S, BS, 2, KVH, D]
    layer: int,
    kv_new: torch.Tensor,  # [T, 2, KVH, D] float32, the model's basis
    slot_block_ids: torch.Tensor,  # [T] long
    slot_offsets: torch.Tensor,  # [T] long
    stored_values: bool,
) -> torch.Tensor:  # [T, 2, KVH, D]: as stored (dequantized) when ``stored_values``, else kv_new
    """``PagedKVCache.write`` of a compact cache with the rotation, the quantize and the scatter in C (one
    call instead of ~20 small torch ops a layer, ~280 us inside a decode step). The codes are what
    ``kv_quant.quantize`` chooses for the same rotated rows (the same candidates and rounding; only the
    order its error sums are added in differs, which can matter only on an exact tie between two
    candidates). The rotation is the C kernel's ``x @ R`` for every write, prefill and decode alike
    (the decode program makes the same call), not torch's matmul."""
    kv_new = kv_new.contiguous()
    t, two, kvh, d = kv_new.shape
    rotation = kv_cache.rotation
    out = torch.empty_like(kv_new) if stored_values else None
    steps = scale_steps(kv_new.device)
    ids = slot_block_ids.to(torch.long).contiguous()
    offsets = slot_offsets.to(torch.long).contiguous()
    raw, esize = kv_cache.raw, kv_cache.raw.element_size()
    data_bytes = kv_cache.data_bytes if kv_cache.scales is not None else raw[0, 0].numel() * esize
    lib.kv_store_quantized(
        FORMAT_IDS[kv_cache.fmt.name], kv_new.data_ptr(), two * kvh * d, t, two * kvh, d,
        None if rotation is None else rotation.data_ptr(), steps.data_ptr(), steps.numel(),
        kv_cache.scale_factor, raw.data_ptr() + layer * raw.stride(1) * esize, raw.stride(0) * esize,
        data_bytes, ids.data_ptr(), offsets.data_ptr(), None if out is None else out.data_ptr(),
    )  # fmt: skip
    return kv_new if out is None else out  # without stored values, callers read only the shape


def decode_attention(call: StepCall, q: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer's decode attention through a step's prepared call: q [B, H, D] -> [B, H * D]."""
    return call.run(q, layer)


if __name__ == "__main__":  # `python -m kvtier.models.kvkernels`: build now (make setup)
    print(f"kvtier: compact-KV decode kernel {'ready' if kernels() else 'not built'}: {library_path(SOURCE)}")
