"""Gemma 3 (text): Qwen3's q/k-normed attention inside a four-norm "sandwich" layer.

Per layer, every norm an RMSNorm of the form x * (1 + w), computed like HF's Gemma3RMSNorm (in float32,
then cast to the compute dtype: the weights are kept as float32 ``1 + w``, so ``rms_norm`` is it)::

    x   = embed(ids) * sqrt(hidden)                        (the scale cast to the embedding dtype first)
    h   = rms_norm(x, input_norm)
    a   = attention(h)                                     q/k norm as Qwen3, scale query_pre_attn_scalar^-0.5
    x  += rms_norm(a @ W_o, attn_out_norm)                 (post_attention_layernorm)
    h   = rms_norm(x, ffn_norm)                            (pre_feedforward_layernorm)
    x  += rms_norm((gelu_tanh(gate) * up)(h) @ W_down, ffn_out_norm)   (post_feedforward_layernorm)
    logits = rms_norm(x, final_norm) @ embed^T             (tied; cap * tanh(logits / cap) when capped)

``ModelConfig.layer_types`` says which layers slide: a ``sliding_attention`` layer attends to the last
``sliding_window`` positions (q - W < k <= q, HF's mask) and rotates with the local RoPE base
(``rope_local_theta``, 10k); a ``full_attention`` layer uses the global base and ``rope_scaling``.

Fast paths (docs/models.md): the fused RMSNorm and RoPE ops, and the fused decode attention kernel for
full layers (and sliding ones while the context fits the window); the GELU gate, the q/k norm and the
windowed decode rows run through torch; the C decode program (llama's layer only) does not run.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvtier.config import ModelConfig
from kvtier.models.fused_ops import TorchOps, ops_for
from kvtier.models.kv_quant import PagedKVCache
from kvtier.models.llama import Packed, StepMetadata, rope_table
from kvtier.models.qwen3 import Qwen3Layer, Qwen3Model


class Gemma3Layer(Qwen3Layer):
    """Qwen3's layer with Gemma's four norms (llama's ``post_norm`` is split into three)."""

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
        del self.post_norm  # llama's norm before the MLP: Gemma's is pre_feedforward_layernorm

        def norm(name: str) -> torch.Tensor:  # [hidden] float32
            return self.norm_weight(w[prefix + name + ".weight"], dtype)

        self.input_norm = norm("input_layernorm")
        self.attn_out_norm = norm("post_attention_layernorm")
        self.ffn_norm = norm("pre_feedforward_layernorm")
        self.ffn_out_norm = norm("post_feedforward_layernorm")

    @staticmethod
    def norm_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gemma's ``1 + w`` in float32, what HF's Gemma3RMSNorm multiplies by whatever the dtype."""
        return 1.0 + w.float()


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """GeGLU's gate * up: gelu_tanh(gate) * up into ``out``."""
    inter = gate_up.shape[1] // 2
    return torch.mul(F.gelu(gate_up[:, :inter], approximate="tanh"), gate_up[:, inter:], out=out)


class Gemma3Model(Qwen3Model):
    """Gemma 3's forward: scaled embedding, sandwich norms, local/global RoPE, softcapped logits."""

    layer_class = Gemma3Layer

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
        c, device = config, self.embed.device
        self.final_norm = Gemma3Layer.norm_weight(weights["model.norm.weight"], dtype)  # [hidden] float32
        # HF's Gemma3TextScaledWordEmbedding: sqrt(hidden) as a float32 tensor, cast to the embedding dtype
        self.embed_scale = torch.tensor(c.hidden_size**0.5).to(device=device, dtype=dtype)
        self.scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        local = dataclasses.replace(c, rope_theta=c.rope_local_theta or c.rope_theta, rope_scaling=None)
        self.local_rope = rope_table(local, max_positions).to(device)  # [P, D/2] complex64
        self.local_torch_ops = TorchOps(self.local_rope)
        self.local_ops = ops_for(dtype, self.local_rope) if self.embed.is_cpu else self.local_torch_ops
        # [L]: whether each layer rotates with the local base (HF: by layer type, window or not)
        self.local = [t == "sliding_attention" for t in c.layer_types]

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
        cpu = input_ids.is_cpu
        global_ops = self.ops if cpu else self.torch_ops
        local_ops = self.local_ops if cpu else self.local_torch_ops
        global_ops.begin(positions)
        local_ops.begin(positions)
        x = F.embedding(input_ids, self.embed) * self.embed_scale  # [T, hidden]
        # per-step buffers, reused by every layer (each is consumed before the next layer writes it)
        h = torch.empty_like(x)  # [T, hidden] a norm's output
        out = torch.empty_like(x)  # [T, hidden] o / down projection's output
        qkv = x.new_empty(T, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        gate_up = x.new_empty(T, 2 * c.intermediate_size)
        act = x.new_empty(T, c.intermediate_size)
        for i, layer in enumerate(self.layers):
            ops = local_ops if self.local[i] else global_ops
            attn = self.attention(
                i, layer, ops.rms_norm(x, layer.input_norm, eps, h), qkv, positions, kv_cache, kv[i], ops
            )
            x.add_(ops.rms_norm(layer.o(attn, out), layer.attn_out_norm, eps, h))
            gate_up = layer.gate_up(ops.rms_norm(x, layer.ffn_norm, eps, h), gate_up)  # [T, 2 * I]
            x.add_(ops.rms_norm(layer.down(gelu_tanh_mul(gate_up, act), out), layer.ffn_out_norm, eps, h))
        return global_ops.rms_norm(x, self.final_norm, eps, torch.empty_like(x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] float32
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the compute dtype, as HF caps
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
