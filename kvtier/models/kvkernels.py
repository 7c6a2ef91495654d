"""The compact-KV decode attention kernel (``kvattn.c``): built like the weight kernels, loaded with ctypes.

``decode_attention`` runs a decode group's attention for one layer straight over the uint8 pool of a
``PagedKVCache`` (fp8_e4m3, fp8_e5m2, int8): per sequence and KV head, scores over the stored K
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

from kvtier.models.kv_quant import PagedKVCache
from kvtier.models.qkernels import library_path, load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kvattn.c")
FORMAT_IDS = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}  # kvattn.c's KV_INT8, KV_E4M3, KV_E5M2
MAX_GROUP = 8  # query heads per KV head the kernel is specialized for
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64
# Context tokens x KV heads from which a call forks OpenMP threads (each sequence's context split in
# parts). Off by default ($KVTIER_KV_KERNEL_PARALLEL_MIN sets it): the kernel's OpenMP pool is not
# torch's, and on the shared 2-core machine (loaded) with torch at 2 threads a 4k-context int8 decode
# step took 1,078 ms with the kernel forking vs 726 ms serial (fp32 KV: 729 ms), median of 8.
PARALLEL_MIN = int(os.environ.get("KVTIER_KV_KERNEL_PARALLEL_MIN", 1 << 62))
PART_TOKENS = 512  # the smallest context part a thread takes
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
        lib.kv_decode_attention.argtypes = [i32, p, i64, i64, p, i64, p, i64, p, p, p]
        lib.kv_decode_attention.argtypes += [i64, i64, i64, i64, i64, ctypes.c_float, i64, p, i32]
        lib.kv_decode_attention.restype = None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("kvtier: compact-KV decode kernel unavailable (%s); using the torch path", exc)
        lib = None
    _state["lib"] = lib
    return lib


def supports(kv_cache: PagedKVCache, num_heads: int) -> bool:
    """Whether the kernel covers this cache: fp8/int8 on CPU, float32 compute, a head_dim that is a
    multiple of 64 up to 256, blocks of at most 64 tokens, at most 8 query heads per KV head."""
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


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [B, H, D] float32, the model's basis (not rotated)
    kv_cache: PagedKVCache,  # compact: raw uint8 [NB, L, layer_bytes]
    layer: int,
    block_tables: torch.Tensor,  # [B * max_blocks] long
    context_lens: torch.Tensor | None,  # [B] long; None: every sequence has max_context tokens
    max_context: int,
    scale: float,
) -> torch.Tensor:  # [B, H * D] float32, the model's basis
    b, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.token_shape[1]
    group = num_heads // num_kv_heads
    raw = kv_cache.raw
    q = q.contiguous()
    # the kernel reads raw int64 block ids and lengths: anything else would be misread
    block_tables = block_tables.to(torch.long).contiguous()
    if context_lens is not None:
        context_lens = context_lens.to(torch.long).contiguous()
    out = torch.empty(b, num_heads * head_dim, dtype=torch.float32)
    threads, parts = _plan(b, num_kv_heads, max_context)
    scratch = _buffer(b * num_kv_heads * (group * head_dim + parts * (group * head_dim + 2 * group)))
    rot = kv_cache.rotation
    lib.kv_decode_attention(
        FORMAT_IDS[kv_cache.fmt.name],
        raw.data_ptr() + layer * raw.stride(1),
        raw.stride(0),
        kv_cache.data_bytes,
        block_tables.data_ptr(),
        block_tables.shape[0] // b,
        None if context_lens is None else context_lens.data_ptr(),
        max_context,
        q.data_ptr(),
        None if rot is None else rot.data_ptr(),
        out.data_ptr(),
        b,
        kv_cache.block_size,
        num_kv_heads,
        group,
        head_dim,
        scale,
        parts,
        scratch.data_ptr(),
        threads,
    )
    return out


if __name__ == "__main__":  # `python -m kvtier.models.kvkernels`: build now (make setup)
    print(f"kvtier: compact-KV decode kernel {'ready' if kernels() else 'not built'}: {library_path(SOURCE)}")
