"""The small per-layer ops of a forward pass (RMSNorm, RoPE, SwiGLU's gate * up), two ways.

``TorchOps`` is the torch code the model always ran; ``FusedOps`` calls the C kernels of ``fused.c``
(one ctypes call instead of 3-6 small torch ops, ~30 layers x 25 ops a decode step). Both write into
buffers the caller passes (allocated once per step, reused by every layer). ``ops_for`` picks
``FusedOps`` for fp32 on CPU when the kernels build, else ``TorchOps`` (``KVTIER_NO_KERNELS=1``,
no compiler, no AVX2, bf16/fp16). The fused ops round like torch's except RMSNorm's sum order and
silu's exp polynomial: logits stay within the parity tests' 1e-4 of transformers.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kvtier.models.attention import AttentionMetadata, write_kv
from kvtier.models.kv_quant import PagedKVCache


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, bit for bit in fp32: w * (x * rsqrt(mean(x^2) + eps)). On CPU this is ~5x faster
    than ``F.rms_norm`` for long inputs (which decomposes into more ops, with dtype round trips). On CUDA,
    with the weight in the input's dtype, ``F.rms_norm``: torch's fused kernel, one launch where this
    takes 6 (fp32) to 9 (bf16/fp16), twice a layer: most of an eager decode step's launches."""
    if x.is_cuda and w.dtype == x.dtype:
        return rms_norm_fused(x, w, eps)
    if x.dtype != torch.float32:
        return (rms_norm_torch(x.float(), w.float(), eps)).to(x.dtype)
    return torch.rsqrt(torch.mean(x * x, -1, keepdim=True).add_(eps)).mul(x).mul_(w)


def rms_norm_fused(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` over the last dim of ``x`` [..., D], scaled by ``w``: [D] (one weight for every row,
    fused into the kernel) or any shape that broadcasts against ``x`` (Qwen3's q/k norm, [H + KVH, D]:
    one row a head, applied after the kernel, which takes only a [D] weight)."""
    if w.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.rms_norm(x, (x.shape[-1],), None, eps).mul_(w)


def rope_then_write(
    ops: TorchOps | FusedOps, qkv: torch.Tensor, positions: torch.Tensor, heads: tuple[int, int, int],
    kv_cache: PagedKVCache, layer: int, meta: AttentionMetadata,
) -> torch.Tensor:  # fmt: skip
    """``ops.rope_`` on the Q and K heads of ``qkv`` [T, (H + 2*KVH) * D], then ``write_kv`` of its K|V
    part: the new K/V as stored, [T, 2, KVH, D]."""
    num_heads, num_kv_heads, head_dim = heads
    ops.rope_(qkv, positions, num_heads + num_kv_heads, head_dim)
    kv_new = qkv[:, num_heads * head_dim :].view(qkv.shape[0], 2, num_kv_heads, head_dim)
    return write_kv(kv_cache, layer, kv_new, meta)


class TorchOps:
    """The torch ops (any dtype, any device). ``out`` buffers are ignored where torch allocates."""

    attention_kernel = False  # decode attention through torch too (kvtier/models/attention.py)

    def __init__(self, rope: torch.Tensor):
        self.rope = rope  # [P, D/2] complex64

    def begin(self, positions: torch.Tensor) -> None:  # once per step
        self.freqs = self.rope.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2] complex64

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, w, eps)

    def rope_(self, qk: torch.Tensor, positions: torch.Tensor, num_heads: int, head_dim: int) -> None:
        """Rotate interleaved pairs of ``qk`` ([T, >= n*D], a view into the fused QKV output) in place."""
        T = qk.shape[0]
        part = qk[:, : num_heads * head_dim]
        if qk.dtype == torch.float32:
            torch.view_as_complex(part.view(T, num_heads, head_dim // 2, 2)).mul_(self.freqs)
        else:  # no complex bf16/fp16 on CPU: rotate in fp32 and write back
            x32 = part.float().view(T, num_heads, head_dim // 2, 2)
            rotated = torch.view_as_real(torch.view_as_complex(x32) * self.freqs)
            part.copy_(rotated.view(T, num_heads * head_dim))

    def rope_store(
        self, qkv: torch.Tensor, positions: torch.Tensor, heads: tuple[int, int, int],
        kv_cache: PagedKVCache, layer: int, meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """RoPE on the Q and K heads of ``qkv`` ([T, (H + 2*KVH) * D], in place), then the new K/V
        written to their slots; returns them as stored ([T, 2, KVH, D], ``write_kv``'s result). A layered
        load in flight (``kv_cache.gate``): the layer's slot is waited for first, before the layer writes
        or reads the pool."""
        if kv_cache.gate is not None:
            kv_cache.gate.wait(layer)
        return rope_then_write(self, qkv, positions, heads, kv_cache, layer, meta)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        inter = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])


class FusedOps:
    """The same ops through ``fused.c`` (fp32, CPU, contiguous rows)."""

    attention_kernel = True  # decode attention through kvattn.c where it covers the cache

    def __init__(self, lib: ctypes.CDLL, rope: torch.Tensor):
        self.lib = lib
        self.table = torch.view_as_real(rope).contiguous()  # [P, D/2, 2] float32 (cos, sin)
        self.table_ptr = self.table.data_ptr()

    def begin(self, positions: torch.Tensor) -> None:
        self.positions = positions.contiguous()  # [T] int64, kept alive for the step

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
        T, H = x.shape
        self.lib.kv_rmsnorm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), H, T, H, eps)
        return out

    def rope_(self, qk: torch.Tensor, positions: torch.Tensor, num_heads: int, head_dim: int) -> None:
        T = qk.shape[0]
        ptr = self.positions.data_ptr()
        self.lib.kv_rope(qk.data_ptr(), qk.stride(0), self.table_ptr, ptr, T, num_heads, head_dim)

    def rope_store(
        self, qkv: torch.Tensor, positions: torch.Tensor, heads: tuple[int, int, int],
        kv_cache: PagedKVCache, layer: int, meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """``TorchOps.rope_store`` in one C call when the pool is plain float32 (``auto``'s): RoPE, then
        each token's K|V row copied to its slot (instead of torch's index_put, ~30 us a layer)."""
        num_heads, num_kv_heads, head_dim = heads
        raw = kv_cache.raw
        if kv_cache.gate is not None:
            kv_cache.gate.wait(layer)  # as ``TorchOps.rope_store``
        if not kv_cache.writes_float32_rows:
            return rope_then_write(self, qkv, positions, heads, kv_cache, layer, meta)
        T, q_size = qkv.shape[0], num_heads * head_dim
        pool = raw.data_ptr() + layer * raw.stride(1) * raw.element_size()
        args = (
            self.positions.data_ptr(),
            T,
            num_heads + num_kv_heads,
            head_dim,
            q_size,
            qkv.shape[1] - q_size,
        )
        self.lib.kv_rope_store(
            qkv.data_ptr(), qkv.stride(0), self.table_ptr, *args, pool, meta.slot_bytes(kv_cache).data_ptr()
        )
        return qkv[:, q_size:].view(T, 2, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.lib.kv_silu_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])
        return out


def ops_for(dtype: torch.dtype, rope: torch.Tensor) -> TorchOps | FusedOps:
    """``FusedOps`` for fp32 when ``fused.c`` builds here, else ``TorchOps``."""
    if dtype == torch.float32:
        from kvtier.models.qkernels import FUSED, kernels

        lib = kernels(FUSED)
        if lib is not None:
            return FusedOps(lib, rope)
    return TorchOps(rope)
