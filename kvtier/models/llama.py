"""Llama-family decoder written for paged attention (Llama 2/3, Mistral, SmolLM, TinyLlama).

The model knows nothing about scheduling: one call runs ``T`` flattened tokens of a step through
every layer, reading and writing K/V through ``AttentionMetadata``. Weights are fused at load time
(Q|K|V into one matrix, gate|up into one) so a layer is a handful of large ops.

RoPE layout: the Q and K rows of each head are permuted at load time from HF's half-split layout
(pairs ``(i, i + D/2)``) to interleaved pairs ``(2i, 2i + 1)``, so RoPE is one complex multiply done
in place. The same permutation is applied to Q and K, so every ``q·k`` — and hence the output — is
unchanged; only the cached K rows are stored in the interleaved order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvtier.config import ModelConfig
from kvtier.models import attention_backend
from kvtier.models.attention import AttentionMetadata, paged_attention
from kvtier.models.decode_program import DecodeProgram
from kvtier.models.fused_ops import FusedOps, TorchOps, ops_for
from kvtier.models.kv_quant import PagedKVCache
from kvtier.models.qlinear import DenseLinear, QuantLinear, calibrate, calibrate_dense

Packed = dict  # group name -> (block type, uint8 rows, scale | None): kvtier/models/qpack.py
# A step's attention metadata: one per KV group of the model's layout (``LlamaModel.layer_kv``), or one
# alone for a pool of one slot per layer (every layer reading one table: teacher-forced passes, tests).
StepMetadata = AttentionMetadata | Sequence[AttentionMetadata]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[D/2] float32 inverse frequencies, with HF's ``llama3`` / ``linear`` rope_scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def rope_table(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, D/2] complex64: e^{i·pos·θ_j}, computed like HF (fp32 angles)."""
    inv_freq = rope_inv_freq(config)
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def _interleave_rows(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Permute each head's rows from half-split (HF) to interleaved RoPE pairs. w: [H*D, ...]."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    return w.view(num_heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


def _transposed(*ws: torch.Tensor) -> torch.Tensor:
    """Row-stacked [out_i, in] weights -> one contiguous [in, sum(out_i)] matrix (a single copy)."""
    return torch.cat([w.t() for w in ws], dim=1).contiguous()


def _make_linear(
    packed: Packed,
    lib: object,
    group: str,
    dense: Callable[[], torch.Tensor],
    b: torch.Tensor | None,
    cached: dict[str, torch.Tensor],
    shape: tuple[int, int],
    dtype: torch.dtype,
) -> DenseLinear | QuantLinear:
    """The packed quantized group when there is one, else the dense transposed weight: ``cached[group]``
    (kvtier/models/qpack.py keeps them) when its shape and dtype fit, or ``dense()`` built now.

    Dense weights are stored transposed ([in, out] = ``shape``): MKL's sgemm on that operand is up to 4x
    faster than F.linear's [out, in] for the small batches of decode steps."""
    if group in packed:
        qtype, data, scale = packed[group]
        return QuantLinear(lib, qtype, data, scale, None if b is None else b.float())
    w = cached.get(group)
    fits = w is not None and tuple(w.shape) == shape and w.dtype == dtype and w.is_contiguous()
    return DenseLinear(w if fits else dense(), b)


class LlamaLayer:
    """One decoder layer's fused weights (plain objects: no nn.Module on the hot path). ``packed``
    (weight_dtype gguf / int8) replaces the dense fused matrices it holds by quantized ones."""

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
        c = config
        H, KVH, D, I = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        packed, cached, g = packed or {}, cached or {}, "layers." + prefix.split(".")[2] + "."

        def linear(name: str, dense: Callable[[], torch.Tensor], b: torch.Tensor | None, shape: tuple):
            return _make_linear(packed, lib, g + name, dense, b, cached, shape, dtype)

        def get(name: str) -> torch.Tensor:
            return w[prefix + name].to(dtype)

        def qkv(kind: str) -> list[torch.Tensor]:
            q = _interleave_rows(get(f"self_attn.q_proj.{kind}"), H, D)
            k = _interleave_rows(get(f"self_attn.k_proj.{kind}"), KVH, D)
            return [q, k, get(f"self_attn.v_proj.{kind}")]

        self.input_norm = get("input_layernorm.weight")  # [hidden]
        self.post_norm = get("post_attention_layernorm.weight")  # [hidden]
        b_qkv = torch.cat(qkv("bias")) if c.attention_bias else None
        # [hidden, (H + 2*KVH) * D]
        qkv_shape = (c.hidden_size, (H + 2 * KVH) * D)
        self.qkv = linear("qkv", lambda: _transposed(*qkv("weight")), b_qkv, qkv_shape)
        has_o_bias = c.attention_bias and prefix + "self_attn.o_proj.bias" in w
        b_o = get("self_attn.o_proj.bias") if has_o_bias else None
        o_dense = lambda: _transposed(get("self_attn.o_proj.weight"))  # noqa: E731 -- [H*D, hidden]
        self.o = linear("o", o_dense, b_o, (H * D, c.hidden_size))
        b_gate_up = torch.cat([get("mlp.gate_proj.bias"), get("mlp.up_proj.bias")]) if c.mlp_bias else None
        gu_dense = lambda: _transposed(get("mlp.gate_proj.weight"), get("mlp.up_proj.weight"))  # noqa: E731
        self.gate_up = linear("gate_up", gu_dense, b_gate_up, (c.hidden_size, 2 * I))  # [hidden, 2*I]
        b_down = get("mlp.down_proj.bias") if c.mlp_bias else None
        down_dense = lambda: _transposed(get("mlp.down_proj.weight"))  # noqa: E731 -- [I, hidden]
        self.down = linear("down", down_dense, b_down, (I, c.hidden_size))

    @property
    def linears(self) -> list[DenseLinear | QuantLinear]:
        return [self.qkv, self.o, self.gate_up, self.down]


class LlamaModel:
    """Forward pass over a step's flattened tokens. Stateless apart from its weights.

    The base of the other families (``qwen3.py``, ``gemma3.py``): a subclass names its layer class and
    whether the C decode program (which runs this class's layer only) may run its steps.

    K/V live in the KV groups of ``config.kv_layout()`` (``kvtier/kv/groups.py``): layer ``i`` writes
    and reads slot ``j`` of its group ``g``'s blocks, ``(g, j) = kv_slots[i]``, through group ``g``'s
    metadata (its slot mapping and block tables). A dense model is one group, slot = layer::

        Gemma 3 270M   pool [NB, 3, BS, 2, KVH, D]    layer 5 -> (0, 0)   layer 0 -> (1, 0)
                       metas (full, sliding x 5)       layer 11 -> (0, 1)  layer 6 -> (1, 1) ...
    """

    layer_class: type[LlamaLayer] = LlamaLayer
    runs_decode_program = True

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_positions: int,
        packed: Packed | None = None,  # weight_dtype gguf / int8: kvtier/models/qpack.py
        lib: object = None,  # the kernel library (kvtier/models/qkernels.py) when packed
        cached: dict[str, torch.Tensor] | None = None,  # dense groups kept by qpack.keep_dense
    ):
        self.config = config
        self.dtype = dtype
        c = config
        self.kv_layout = c.kv_layout()
        self.kv_slots = tuple(self.kv_layout.slot_of(i) for i in range(c.num_layers))  # [L] (group, slot)
        self.embed = weights["model.embed_tokens.weight"].to(dtype)  # [V, hidden]
        head = weights.get("lm_head.weight")
        tied = head is None or c.tie_word_embeddings
        # [hidden, V]: a transposed copy even when tied (+V*hidden elements) for the faster matmul
        head_dense = lambda: _transposed(self.embed if tied else head.to(dtype))  # noqa: E731
        head_shape = (c.hidden_size, c.vocab_size)
        self.lm_head = _make_linear(
            packed or {}, lib, "lm_head", head_dense, None, cached or {}, head_shape, dtype
        )
        self.final_norm = weights["model.norm.weight"].to(dtype)
        self.layers = [
            self.layer_class(c, weights, f"model.layers.{i}.", dtype, packed, lib, cached)
            for i in range(c.num_layers)
        ]
        self.rope = rope_table(c, max_positions).to(self.embed.device)  # [P, D/2] complex64
        # RMSNorm / RoPE / gate*up: fused C ops for fp32 on CPU (kvtier/models/fused_ops.py)
        self.torch_ops = TorchOps(self.rope)
        self.ops = ops_for(dtype, self.rope) if self.embed.is_cpu else self.torch_ops
        self.gemv_times = self._choose_gemv()
        self.parallel_min = self._choose_parallel()
        # a decode step's layers in one C call where it covers the step (kvtier/models/decode_program.py)
        # (llama's layer over one KV group: every layer at slot = layer of the one metadata)
        fused = self.runs_decode_program and isinstance(self.ops, FusedOps) and self.kv_layout.is_dense
        self.program = DecodeProgram(self) if fused else None
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.q_size = c.num_heads * c.head_dim
        self.k_size = c.num_kv_heads * c.head_dim

    def layer_kv(self, meta: StepMetadata) -> list[tuple[int, AttentionMetadata]]:
        """[L] (slot, metadata) each layer writes and reads its K/V with: group ``g``'s metadata at slot
        ``j`` for ``(g, j) = kv_slots[i]`` (a dense model: slot i, the one metadata); a lone
        ``AttentionMetadata``: slot i of a pool of one slot per layer, whatever the layout."""
        if isinstance(meta, AttentionMetadata):
            return [(i, meta) for i in range(len(self.kv_slots))]
        if len(meta) != self.kv_layout.num_groups:
            raise ValueError(f"{len(meta)} metadata for {self.kv_layout.num_groups} KV groups")
        return [(j, meta[g]) for g, j in self.kv_slots]

    def select_attention(self, backend: str) -> None:
        """Run attention through ``backend``, resolved for this device (``attention_backend.resolve``):
        ``c`` keeps the model as built (kvattn.c and the C decode program where they cover a step); with
        ``torch`` or ``triton`` every ops object of the model (a family may keep more than ``ops`` and
        ``torch_ops``: Gemma 3's local-RoPE ones) hands that name to ``paged_attention`` (its
        ``kernel``), and the C decode program, which runs kvattn.c itself, is off. Called once, by the
        builder."""
        if backend == attention_backend.C:
            return
        self.program = None
        for ops in vars(self).values():
            if isinstance(ops, TorchOps | FusedOps):
                ops.attention_kernel = backend  # type: ignore[assignment]  # a backend name, not a bool

    def dense_groups(self) -> dict[str, torch.Tensor]:
        """Every dense linear's transposed matrix by group name (``layers.{i}.qkv`` ... ``lm_head``), what
        ``qpack.keep_dense`` stores so a later start can pass them back as ``cached``."""
        linears = {"lm_head": self.lm_head}
        for i, layer in enumerate(self.layers):
            linears.update({f"layers.{i}.{n}": getattr(layer, n) for n in ("qkv", "o", "gate_up", "down")})
        return {g: lin.w_t for g, lin in linears.items() if isinstance(lin, DenseLinear)}

    def _choose_parallel(self) -> int | None:
        """Quantized weights: whether their kernel calls fork threads here, measured on the largest layer
        GEMV (layer 0's gate|up) and set on every QuantLinear. None: no quantized linear."""
        quant = [lin for layer in self.layers for lin in layer.linears] + [self.lm_head]
        quant = [lin for lin in quant if isinstance(lin, QuantLinear)]
        if not quant:
            return None
        gate_up = self.layers[0].gate_up
        parallel_min = calibrate(gate_up if isinstance(gate_up, QuantLinear) else quant[0])
        for lin in quant:
            lin.parallel_min = parallel_min
        return parallel_min

    def _choose_gemv(self, layers: int = 8) -> dict[str, float]:
        """fp32 dense weights: per weight group, MKL or the AVX2 GEMV of ``fused.c`` for decode rows,
        whichever ``calibrate_dense`` measures faster here (over ``layers`` layers and the LM head)."""
        if not isinstance(self.ops, FusedOps):
            return {}
        sample = self.layers[:layers]
        groups = [[getattr(layer, name) for layer in sample] for name in ("qkv", "o", "gate_up", "down")]
        groups.append([self.lm_head])
        dense = [g for g in groups if all(isinstance(lin, DenseLinear) for lin in g)]
        times = calibrate_dense(dense, self.ops.lib) if dense else {}
        for name in ("qkv", "o", "gate_up", "down"):  # the rest of the layers follow their sample
            for layer in self.layers[layers:]:
                lin, first = getattr(layer, name), getattr(self.layers[0], name)
                if isinstance(lin, DenseLinear) and isinstance(first, DenseLinear):
                    lin.gemv = first.gemv
        return times

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_cache: PagedKVCache,  # raw [NB, S, BS, 2, KVH, D] (S slots per block; or its compact form)
        meta: StepMetadata,  # one per KV group (see ``layer_kv``)
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        c = self.config
        T = input_ids.shape[0]
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        ops = self.ops if input_ids.is_cpu else self.torch_ops
        ops.begin(positions)
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        # per-step buffers, reused by every layer (each is consumed before the next layer writes it)
        h = torch.empty_like(x)  # [T, hidden] normed input of qkv / gate_up
        qkv = x.new_empty(T, (H + 2 * KVH) * D)
        gate_up = x.new_empty(T, 2 * c.intermediate_size)
        act = x.new_empty(T, c.intermediate_size)
        kv = self.layer_kv(meta)  # [L] (slot, metadata): one group here, slot = layer
        if self.program is not None and ops is self.ops and self.program.run(x, kv_cache, kv[0][1]):
            return ops.rms_norm(x, self.final_norm, eps, torch.empty_like(x))  # every layer in one C call
        for layer, (slot, m) in zip(self.layers, kv, strict=True):
            qkv = layer.qkv(ops.rms_norm(x, layer.input_norm, eps, h), qkv)  # [T, (H + 2*KVH) * D]
            # RoPE on Q and K heads in place, new K/V into the cache: [T, 2, KVH, D] as stored
            kv_new = ops.rope_store(qkv, positions, (H, KVH, D), kv_cache, slot, m)
            q = qkv[:, : self.q_size].view(T, H, D)
            attn = paged_attention(q, kv_new, kv_cache, slot, m, self.scale, ops.attention_kernel)  # [T, H*D]
            x = layer.o.residual(x, attn)  # x + attn @ W_o
            gate_up = layer.gate_up(ops.rms_norm(x, layer.post_norm, eps, h), gate_up)  # [T, 2 * I]
            x = layer.down.residual(x, ops.silu_mul(gate_up, act))  # x + (silu(gate) * up) @ W_down
        return ops.rms_norm(x, self.final_norm, eps, torch.empty_like(x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] float32
        return self.lm_head(hidden).float()
