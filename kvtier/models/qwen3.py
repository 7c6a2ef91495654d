"""Qwen3: the llama decoder with a per-head RMSNorm on Q and K before RoPE.

A Qwen3 layer is llama's (``llama.py``: pre-norm attention, SwiGLU MLP, fused Q|K|V and gate|up, RoPE
on interleaved pairs) plus ``q_norm`` / ``k_norm``: an RMSNorm over each head's D values, one weight of
D shared by every Q head (and one by every K head), applied to the QKV projection's output before RoPE::

    h   = rms_norm(x, input_norm)                          [T, hidden]
    qkv = h @ W_qkv                                        [T, (H + 2*KVH) * D]
    q, k = rms_norm(q[t, head], q_norm), rms_norm(k[t, head], k_norm)   per head, over D
    q, k = rope(q), rope(k);  k, v -> cache;  x += attention(q) @ W_o
    x  += (silu(gate) * up)(rms_norm(x, post_norm)) @ W_down

No QKV bias; ``head_dim`` is its own config value (not hidden / heads). With ``use_sliding_window``
the layers from ``max_window_layers`` on slide: each layer's window comes from
``ModelConfig.layer_types`` (``Qwen3Model.windows``) and goes to ``paged_attention``.

The norm weights are permuted into the interleaved RoPE order of the Q/K rows they scale (an RMSNorm's
mean does not depend on the order). Fast paths (docs/models.md): the fused RMSNorm / RoPE / SwiGLU ops
and the fused decode attention kernel apply as for llama; the q/k norm runs through torch, and the C
decode program (llama's layer only) does not run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.config import ModelConfig
from kvtier.models.attention import AttentionMetadata, paged_attention
from kvtier.models.fused_ops import FusedOps, TorchOps, rms_norm_torch
from kvtier.models.kv_quant import PagedKVCache
from kvtier.models.llama import LlamaLayer, LlamaModel, Packed, StepMetadata, _interleave_rows


class Qwen3Layer(LlamaLayer):
    """Llama's fused layer plus the q/k norm weights."""

    def __init__(
        self,
        config: ModelConfig,
        w: dict[str, torch.Tensor],
        prefix: str,
        dtype: torch.dtype,
        packed: Packed | None = None,
        lib: object = None,
        cached: dict[str, torch.Tensor] | None = None,
    ):
        super().__init__(config, w, prefix, dtype, packed, lib, cached)
        H, KVH, D = config.num_heads, config.num_kv_heads, config.head_dim
        q_norm = _interleave_rows(self.norm_weight(w[prefix + "self_attn.q_norm.weight"], dtype), 1, D)
        k_norm = _interleave_rows(self.norm_weight(w[prefix + "self_attn.k_norm.weight"], dtype), 1, D)
        # [H + KVH, D]: row j scales head j of the Q|K part of the fused QKV output
        self.qk_norm = torch.cat([q_norm.expand(H, D), k_norm.expand(KVH, D)]).contiguous()

    @staticmethod
    def norm_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An RMSNorm weight as this family multiplies by it ([n] in ``dtype``: HF's Qwen3RMSNorm)."""
        return w.to(dtype)


def qk_norm_(qkv: torch.Tensor, qk_norm: torch.Tensor, eps: float) -> None:
    """RMSNorm over each Q and K head of ``qkv`` ([T, (H + 2*KVH) * D]) in place, head j scaled by row j
    of ``qk_norm`` ([H + KVH, D]): one torch chain for every head (HF's RMSNorm, bit for bit in fp32)."""
    num_heads, head_dim = qk_norm.shape
    qk = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)  # [T, H + KVH, D]
    qk.copy_(rms_norm_torch(qk, qk_norm, eps))


class Qwen3Model(LlamaModel):
    """Llama's forward with the q/k norm and a per-layer attention window."""

    layer_class = Qwen3Layer
    runs_decode_program = False  # decode_program.c runs llama's layer: no q/k norm

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_positions: int,
        packed: Packed | None = None,
        lib: object = None,
        cached: dict[str, torch.Tensor] | None = None,
    ):
        super().__init__(config, weights, dtype, max_positions, packed, lib, cached)
        # [L]: each layer's sliding window (None: full attention)
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]

    def attention(
        self,
        i: int,
        layer: Qwen3Layer,
        h: torch.Tensor,  # [T, hidden] the normed input
        qkv: torch.Tensor,  # [T, (H + 2*KVH) * D] buffer
        positions: torch.Tensor,  # [T] long
        kv_cache: PagedKVCache,
        kv: tuple[int, AttentionMetadata],  # (slot, metadata) of layer i's KV group: ``layer_kv``
        ops: TorchOps | FusedOps,  # RoPE with this layer's table
    ) -> torch.Tensor:  # [T, H * D]
        """Layer ``i``'s attention before its output projection: QKV, q/k norm, RoPE, cache write (at
        its slot of its KV group's blocks), read."""
        c = self.config
        heads = (c.num_heads, c.num_kv_heads, c.head_dim)
        slot, meta = kv
        qkv = layer.qkv(h, qkv)  # [T, (H + 2*KVH) * D]
        qk_norm_(qkv, layer.qk_norm, c.rms_norm_eps)
        kv_new = ops.rope_store(qkv, positions, heads, kv_cache, slot, meta)  # [T, 2, KVH, D] as stored
        q = qkv[:, : self.q_size].view(qkv.shape[0], c.num_heads, c.head_dim)  # [T, H, D]
        return paged_attention(
            q, kv_new, kv_cache, slot, meta, self.scale, ops.attention_kernel, self.windows[i]
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_cache: PagedKVCache,  # raw [NB, S, BS, 2, KVH, D] (S slots per block; or its compact form)
        meta: StepMetadata,  # one per KV group (``LlamaModel.layer_kv``)
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        c = self.config
        T, eps = input_ids.shape[0], c.rms_norm_eps
        kv = self.layer_kv(meta)  # [L] (slot, metadata)
        ops = self.ops if input_ids.is_cpu else self.torch_ops
        ops.begin(positions)
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        # per-step buffers, reused by every layer (each is consumed before the next layer writes it)
        h = torch.empty_like(x)  # [T, hidden] normed input of qkv / gate_up
        qkv = x.new_empty(T, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        gate_up = x.new_empty(T, 2 * c.intermediate_size)
        act = x.new_empty(T, c.intermediate_size)
        for i, layer in enumerate(self.layers):
            attn = self.attention(
                i, layer, ops.rms_norm(x, layer.input_norm, eps, h), qkv, positions, kv_cache, kv[i], ops
            )
            x = layer.o.residual(x, attn)  # x + attn @ W_o
            gate_up = layer.gate_up(ops.rms_norm(x, layer.post_norm, eps, h), gate_up)  # [T, 2 * I]
            x = layer.down.residual(x, ops.silu_mul(gate_up, act))  # x + (silu(gate) * up) @ W_down
        return ops.rms_norm(x, self.final_norm, eps, torch.empty_like(x))
