"""Compact KV blocks: the device pool in fp8 or int8 with per-(token, KV head) scales, or in bfloat16.

``--kv-cache-dtype`` picks what a block stores (``auto``: the compute dtype, exactly as before)::

    kv dtype   element            scale (float32)            bytes/token (SmolLM2-135M: L=30, KVH=3, D=64)
    ────────   ────────────────   ────────────────────────   ─────────────────────────────────────────────
    float32    fp32               none                       2 x L x KVH x D x 4      = 46,080
    bfloat16   bf16               none                       2 x L x KVH x D x 2      = 23,040  (2.00x)
    fp8_e4m3   float8_e4m3fn      one per (token, layer,     2 x L x KVH x (D + 4)    = 12,240  (3.76x)
    fp8_e5m2   float8_e5m2          K or V, KV head):
    int8       int8, symmetric      amax / qmax

A quantized block is one byte string, so every tier (host, disk, remote) moves and stores it as it is,
and the scales travel with their data. Inside the block each layer is a contiguous row::

    raw pool: uint8 [NB, L, layer_bytes]        layer_bytes = BS*2*KVH*D + BS*2*KVH*4
    one layer row:  [ data  BS x 2 x KVH x D  (1 byte each) | scales  BS x 2 x KVH  (float32) ]

so attention gathers one layer of the blocks it reads with a single ``index_select`` of bytes and
converts only those (``q.float()``, vectorized over the whole gather): a prefill chunk then multiplies
by the scales, a decode step folds each token's scale into its score and probability instead
(``attention.decode_attention_scaled``).

Writes quantize through the slot mapping, after rotating K and V by a Walsh-Hadamard matrix (every
format: it spreads outlier channels over the head): a new token's K (and V) of one KV head gets its
own scale (int8: ``amax / 127``, rounding to nearest; fp8: the best of ``amax / qmax * 2^(k/8)``, k
= 0..7, qmax 448 for e4m3 and 57344 for e5m2), so a token's bytes are final when written and never
rewritten when its block fills up. Per-(block, KV head) scales would cost 1/BS of the scale bytes,
but a block is filled one token at a time in decode, so its scale would have to grow and its earlier
tokens be requantized; and measured on SmolLM2's real K/V (``kvtier bench kvdtype``, "granularity"
table) they reconstruct K and V worse: the first tokens of a text and a few outlier channels carry
much larger magnitudes than the rest of their block.

Every query attends to the quantized K/V, its own chunk included: ``write`` returns the dequantized
values of the tokens it stored, and a first prefill chunk attends to those (bit for bit what a later
read of the cache returns). vLLM's v1 attention reads the current chunk from the (quantized) cache
too. So a prompt's output does not depend on how it was chunked, cached or preempted, as with ``auto``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.config import QUANTIZED_KV_DTYPES
from kvtier.models.slot_gate import SlotGate

# The torch dtype of each dtype name: compute dtypes (float32, bfloat16, float16) and KV storage.
STORAGE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
_QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}
# Rotated before quantizing (a Walsh-Hadamard transform per KV head, undone on the query and output):
# measured by `kvtier bench kvdtype` and in BENCHMARKS.md (fp8 too: it halves fp8_e4m3's perplexity cost).
ROTATED = {"fp8_e4m3": True, "fp8_e5m2": True, "int8": True}
# fp8 scale candidates: amax / qmax times 2^(k/8), k = 0..7 (one binade in 8 steps); each (token, KV
# head) keeps the one whose stored values are closest to its own (least squared error). A float
# format's grid is relative, so where a value's mantissa lands decides its error; int8's grid is
# uniform and amax / 127 is already its best.
FP8_SCALE_STEPS = 8
_NATIVE_FP8_MAX = 1 << 14  # fewer elements convert faster natively (1 op) than through float16 (5)
_TINY = 1e-12  # smallest scale: an all-zero head quantizes to zeros, not NaN


@dataclass(frozen=True)
class KVFormat:
    """How a KV dtype stores values: ``storage`` elements, plus a float32 scale each when quantized."""

    name: str  # a resolved KV dtype: float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8
    compute: torch.dtype  # what attention computes in (the model's dtype)

    @property
    def storage(self) -> torch.dtype:
        return STORAGE_DTYPES[self.name]

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED_KV_DTYPES

    @property
    def qmax(self) -> float:
        return _QMAX[self.name]


_SCALE_STEPS: dict[torch.device, torch.Tensor] = {}


def scale_steps(device: torch.device) -> torch.Tensor:
    """[S] fp8 scale candidates' multipliers 2^(k/S), made once per device (decode writes one token)."""
    if device not in _SCALE_STEPS:
        k = torch.arange(FP8_SCALE_STEPS, dtype=torch.float32)
        _SCALE_STEPS[device] = k.div_(FP8_SCALE_STEPS).exp2_().to(device)
    return _SCALE_STEPS[device]


def quantize(x: torch.Tensor, fmt: KVFormat, scale_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] in ``fmt.storage``, scale [...] float32) with x ~= q * scale.

    ``scale_factor`` exists for the quality test's deliberately broken quantizer (2.0: scales off by 2x)."""
    x32 = x.float()
    scale = x32.abs().amax(-1).div_(fmt.qmax).clamp_min_(_TINY)  # [...]
    if fmt.name == "int8":
        y = x32 / (scale * scale_factor).unsqueeze(-1)
        return y.round_().clamp_(-127, 127).to(torch.int8), scale
    cand = scale.unsqueeze(-1) * scale_steps(x.device)  # [..., S] each keeps amax within range
    trial = (cand * scale_factor).unsqueeze(-1)  # [..., S, 1]
    q = (x32.unsqueeze(-2) / trial).clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage)  # [..., S, D]
    small = q.numel() <= _NATIVE_FP8_MAX  # a decode write: torch's own conversion, one op
    back = (q.float() if small else to_compute(q, torch.float32)).mul_(trial)  # [..., S, D]
    best = back.sub_(x32.unsqueeze(-2)).square_().sum(-1).argmin(-1, keepdim=True)  # [..., 1]
    codes = q.view(torch.uint8).gather(-2, best.unsqueeze(-1).expand(*best.shape, x.shape[-1]))
    return codes.squeeze(-2).view(fmt.storage), cand.gather(-1, best).squeeze(-1)


def to_compute(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [...] stored elements -> [...] their values in ``dtype``, before any scale (a new tensor)."""
    values, factor = _to_compute_over(q, dtype)
    return values if factor == 1.0 else values.mul_(factor)


Alloc = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]  # (name, shape, dtype) -> buffer


def _to_compute_over(
    q: torch.Tensor, dtype: torch.dtype, alloc: Alloc | None = None
) -> tuple[torch.Tensor, float]:
    """q [...] -> (values [...] in ``dtype``, factor): the stored values are ``values * factor`` (a
    power of two a reader folds into its scales, saving a pass). ``alloc`` gives the output buffers.

    torch converts fp8 to float one element at a time on CPU, so fp8 goes through float16 (whose
    conversion is vectorized) with integer ops on the 16-bit patterns, bit for bit what ``q.to(dtype)``
    gives for every pattern a write stores (NaN patterns never are: writes clamp to +-qmax).
    e5m2 is the top byte of a float16. e4m3 as a sign-extended int16 times 2^7 puts its exponent and
    mantissa in bits 13..7 of a float16 of value / 2^8 (bias 15 vs 7, subnormals included) and sets
    bits 14 and 15 exactly when negative: clearing bit 14 leaves the sign."""
    if alloc is None:
        alloc = lambda name, shape, dt: torch.empty(shape, dtype=dt, device=q.device)  # noqa: E731
    out = alloc("values", q.shape, dtype)
    if q.dtype not in (torch.float8_e5m2, torch.float8_e4m3fn):
        return out.copy_(q), 1.0
    bits = alloc("bits", q.shape, torch.int16).copy_(q.view(torch.int8))  # sign-extended
    if q.dtype == torch.float8_e5m2:
        return out.copy_(bits.mul_(256).view(torch.float16)), 1.0
    return out.copy_(bits.mul_(128).bitwise_and_(~0x4000).view(torch.float16)), 256.0


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D], scale [...] -> [..., D] in ``dtype`` (one conversion and one multiply)."""
    return to_compute(q, dtype).mul_(scale.to(dtype).unsqueeze(-1))


def hadamard(n: int) -> torch.Tensor | None:
    """[n, n] orthonormal Walsh-Hadamard matrix (Sylvester), or None when n is not a power of two."""
    if n < 1 or n & (n - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On CPU from ``calloc`` (numpy's zeros): a large block comes straight from the
    OS as zero pages, mapped as they are first written, instead of ``torch.zeros`` writing every byte
    at start-up (0.4 s of the default model's ~1 s load for its pool)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class PagedKVCache:
    """The device KV pool: ``raw`` (what tiers move, one row per block) and typed views of it.

    Plain (``auto``/bfloat16): ``raw`` is [NB, S, BS, 2, KVH, D] in the storage dtype.
    Quantized: ``raw`` is uint8 [NB, S, layer_bytes]; ``data`` [NB, S, BS, 2, KVH, D] and ``scales``
    [NB, S, BS, 2, KVH] float32 are views into it (see the module docstring for the row layout).
    S is the layer slots of a block: every layer for a dense model, ``KVLayout.layers_per_group`` for
    a hybrid one (``kvtier/kv/groups.py``); ``layer`` arguments below are slots.
    """

    def __init__(
        self, fmt: KVFormat, num_blocks: int, shape: tuple[int, int, int, int], device: torch.device
    ) -> None:
        num_layers, block_size, num_kv_heads, head_dim = shape  # num_layers: the layer slots S
        self.fmt = fmt
        self.block_size = block_size
        self.token_shape = (2, num_kv_heads, head_dim)
        self.scale_factor = 1.0  # != 1 only in the quality test's broken quantizer
        nb, bs, kvh, d = num_blocks, block_size, num_kv_heads, head_dim
        self.rotation: torch.Tensor | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # gather_unscaled(reuse=True)'s, by name
        # layered loads in flight (kvtier/models/slot_gate.py): a layer waits for its slot before reading
        self.gate: SlotGate | None = None
        if not fmt.quantized:
            self.raw = _zeros((nb, num_layers, bs, 2, kvh, d), fmt.storage, device)
            self.data, self.scales = self.raw, None
            return
        rotation = hadamard(d) if ROTATED[fmt.name] else None
        self.rotation = None if rotation is None else rotation.to(device=device, dtype=fmt.compute)  # [D, D]
        self.data_bytes = bs * 2 * kvh * d
        layer_bytes = self.data_bytes + bs * 2 * kvh * 4
        self.raw = _zeros((nb, num_layers, layer_bytes), torch.uint8, device)
        self.data = self.raw[:, :, : self.data_bytes].view(fmt.storage).view(nb, num_layers, bs, 2, kvh, d)
        self.scales = self.raw[:, :, self.data_bytes :].view(torch.float32).view(nb, num_layers, bs, 2, kvh)

    @property
    def writes_float32_rows(self) -> bool:
        """Whether a write is a plain copy of float32 K|V rows into ``raw`` on CPU (``auto`` with fp32
        compute), which the fused RoPE + store op (``FusedOps.rope_store``) then does itself; not for a
        subclass that writes otherwise."""
        plain = self.scales is None and self.raw.dtype == torch.float32 and self.raw.is_cpu
        return plain and type(self).write is PagedKVCache.write

    def write(
        self,
        layer: int,
        kv_new: torch.Tensor,
        slot_block_ids: torch.Tensor,
        slot_offsets: torch.Tensor,
        stored_values: bool = True,
    ) -> torch.Tensor:
        """Store kv_new [T, 2, KVH, D] into its slots; returns [T, 2, KVH, D] in the compute dtype: the
        values a later read of those slots returns (``kv_new`` itself when stored as it is, or when
        ``stored_values`` is False: the caller reads only its shape)."""
        if self.scales is None:
            stored = kv_new.to(self.fmt.storage)  # kv_new itself when the dtypes match
            self.data[slot_block_ids, layer, slot_offsets] = stored
            return kv_new if stored is kv_new else stored.to(kv_new.dtype)
        if self.rotation is not None:
            kv_new = self._rotate(kv_new)
        q, scale = quantize(kv_new, self.fmt, self.scale_factor)  # [T, 2, KVH, D], [T, 2, KVH]
        self.data[slot_block_ids, layer, slot_offsets] = q
        self.scales[slot_block_ids, layer, slot_offsets] = scale
        return dequantize(q, scale, kv_new.dtype) if stored_values else kv_new

    def gather(self, layer: int, block_table: torch.Tensor) -> torch.Tensor:
        """[n] block ids -> [n * BS, 2, KVH, D] in the compute dtype (one copy of just those blocks)."""
        values, scale = self.gather_unscaled(layer, block_table)
        if scale is None:
            return values
        return values.mul_(scale.to(values.dtype).unsqueeze(-1))  # = dequantize(), bit for bit

    def gather_unscaled(
        self, layer: int, block_table: torch.Tensor, reuse: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n] block ids -> (values [n * BS, 2, KVH, D] in the compute dtype, scales [n * BS, 2, KVH]
        float32), the stored elements before their scales, so that decode attention can apply a
        token's scale to its one score and one probability instead of to its D values; scales None
        (and the values a view when the dtypes match) when not quantized.

        ``reuse``: a compact read lands in buffers this cache keeps (grown as needed) instead of fresh
        ones, and is overwritten by the next such read: decode reads the whole context every step,
        and fresh multi-MB buffers cost page faults each time."""
        n = block_table.shape[0]
        rows = self.raw.select(1, layer)  # [NB, ...] one layer of every block
        rows = rows.reshape(rows.shape[0], -1)
        if self.scales is None:
            out = rows.index_select(0, block_table).view(n * self.block_size, *self.token_shape)
            return (out if out.dtype == self.fmt.compute else out.to(self.fmt.compute)), None
        alloc = self._scratch if reuse else None
        if alloc is None:
            flat = rows.index_select(0, block_table)  # [n, layer bytes]
        else:
            flat = torch.index_select(rows, 0, block_table, out=alloc("rows", (n, rows.shape[1]), rows.dtype))
        data = flat[:, : self.data_bytes].view(self.fmt.storage)  # [n, BS*2*KVH*D] (a view)
        scale = flat[:, self.data_bytes :].view(torch.float32)  # [n, BS*2*KVH] (a view)
        values, factor = _to_compute_over(data, self.fmt.compute, alloc)  # [n, BS*2*KVH*D]
        scale = scale.reshape(n * self.block_size, 2, -1)  # [n*BS, 2, KVH]
        return values.view(n * self.block_size, *self.token_shape), scale if factor == 1.0 else scale * factor

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` kept under ``name`` (reallocated only to grow)."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=self.raw.device)
        return buf[:numel].view(shape)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] @ R as one 2-D mm (a batched matmul on a strided view is ~1000x slower on CPU)."""
        assert self.rotation is not None
        d = self.rotation.shape[0]
        return torch.mm(x.reshape(-1, d), self.rotation).view(x.shape)

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] into the basis K is stored in (itself without a rotation)."""
        return q if self.rotation is None else self._rotate(q)

    def unrotate_output(self, out: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Attention output [T, H * D] (a mix of rotated V rows) back to the model's basis: R is a
        symmetric orthonormal Hadamard matrix, so R^-1 = R^T = R."""
        return out if self.rotation is None else self._rotate(out)
