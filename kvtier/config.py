"""Frozen configuration records, and how user arguments resolve into them.

Each record is owned by one layer of the engine:

* ``ModelConfig``     — the architecture, read from a model's files by ``kvtier.models.loader``.
* ``CacheConfig``     — the device block pool (block size, how many blocks, prefix caching).
* ``SchedulerConfig`` — continuous batching limits (token budget, sequences per step, model length).
* ``TierConfig``      — the tiers under the device pool (host memory, disk) and their sizes.
* ``EngineArgs``      — what a user passes to ``LLM(...)`` or the CLI (checked by ``kvtier.config_checks``).

``resolve_engine_config(args, model)`` turns ``EngineArgs`` and a ``ModelConfig`` into an
``EngineConfig`` holding the other records: pool sizes in blocks, the capped ``max_model_len``. It is
the single source of truth the engine builds from. Nothing here imports torch, so the scheduler side
and its tests stay torch-free.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

# ConfigError and check_choice live with the checks; every module imports them from here
from kvtier.config_checks import ConfigError as ConfigError
from kvtier.config_checks import check_choice as check_choice
from kvtier.config_checks import check_engine_args
from kvtier.kv import groups, write_ahead

DType = Literal["auto", "float32", "bfloat16", "float16"]
PreemptionMode = Literal["auto", "swap", "recompute"]
StorePolicy = Literal["write_back", "write_through"]
# KV cache precision: "auto" is the compute dtype; "fp8" is an alias of "fp8_e4m3" (kvtier/models/kv_quant.py)
KVCacheDType = Literal["auto", "bfloat16", "fp8_e4m3", "fp8", "fp8_e5m2", "int8"]
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
QUANTIZED_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
# A quantized KV dtype stores one float32 scale per (token, layer, K or V, KV head) next to the data.
KV_SCALE_BYTES = 4
SchedulingPolicy = Literal["stall_free", "legacy"]
# Weight precision (docs/weight-dtype.md): "auto" dense as loaded; "gguf" the GGUF's own quantized blocks;
# "int8" per-channel weight-only int8. gguf/int8 run fp32 activations through kvtier/models/qmatmul.c.
WeightDType = Literal["auto", "gguf", "int8"]
# Attention kernels (kvtier/models/attention_backend.py): auto picks triton on CUDA, the C kernels on a CPU.
AttentionBackend = Literal["auto", "torch", "c", "triton"]
DEFAULT_KV_DEVICE_GB = 1.0
# A layer's attention kind, as HF's ``layer_types`` names it (ModelConfig.layer_types).
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder the engine runs: a model family of ``kvtier/models/registry.py``
    (``llama``: Llama, Mistral, SmolLM, TinyLlama, Qwen2-style biases; ``qwen3``; ``gemma3``), its
    sizes, and each layer's attention kind."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF ``rope_scaling`` dict (types "llama3" and "linear" are supported), or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The precision the weights were published in ("float32", "bfloat16", "float16").
    # A quantized GGUF reports "float32": it is dequantized to fp32 on CPU.
    native_dtype: str = "float32"
    # The model family that runs it (kvtier/models/registry.py): "llama", "qwen3" or "gemma3".
    family: str = "llama"
    # Each layer's attention kind, HF's ``layer_types`` names: "full_attention" (every earlier token)
    # or "sliding_attention" (the last ``sliding_window`` positions, the new one included). Empty
    # means every layer full; ``__post_init__`` fills it in, so it always has ``num_layers`` entries.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # tokens a sliding layer attends to (None: no sliding layer)
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma 3); None: head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if unknown := set(self.layer_types) - set(LAYER_TYPES):
            raise ConfigError(
                f"unsupported layer type {sorted(unknown)[0]!r} (supported: {', '.join(LAYER_TYPES)})"
            )
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ConfigError(
                f"sliding_attention layers need a positive sliding_window, got {self.sliding_window}"
            )

    def layer_window(self, layer: int) -> int | None:
        """The tokens layer ``layer`` attends to: ``sliding_window`` for a sliding layer, else None."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def kv_layout(self) -> groups.KVLayout:
        """The model's KV groups (``kvtier/kv/groups.py``): which layers share a block table, and the
        layer slots of every block (a dense model: one group, slot = layer)."""
        return groups.kv_layout(self.layer_types, self.sliding_window)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kv_token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Bytes of K and V of one token over ``num_layers`` layers in ``kv_dtype`` (a resolved KV dtype:
    float32, bfloat16, float16, fp8_e4m3, fp8_e5m2 or int8), scales included: what the engine allocates
    and what ``kvtier plan`` counts for the same name."""
    scale = KV_SCALE_BYTES if kv_dtype in QUANTIZED_KV_DTYPES else 0
    return 2 * num_layers * num_kv_heads * (head_dim * DTYPE_BYTES[kv_dtype] + scale)


def resolve_kv_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The KV dtype a ``kv_cache_dtype`` argument stores under compute ``dtype`` ("auto": ``dtype``)."""
    if kv_cache_dtype == "auto":
        return dtype
    return KV_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: str) -> int:
    """Bytes of one KV block: K and V of ``block_size`` tokens in each layer slot of a KV group (every
    layer for a dense model; ``layers_per_group`` slots for a hybrid one, the same in every group), in
    KV dtype ``dtype`` (scales included for a quantized one)."""
    slots = model.kv_layout().layers_per_group
    return block_size * kv_token_bytes(slots, model.num_kv_heads, model.head_dim, dtype)


def device_pool_blocks(kv_device_gb: float, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` in a ``kv_device_gb`` GiB device pool (the engine's and the planner's)."""
    return int(kv_device_gb * 2**30 // block_bytes)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_device_blocks: int = 0
    enable_prefix_caching: bool = True
    block_bytes: int = 0  # bytes of one block in the device pool (and in every tier)
    kv_dtype: str = "float32"  # what the blocks store: the compute dtype, or fp8_e4m3/fp8_e5m2/int8
    retain_max_fraction: float = 0.5  # of each tier, at most, kept from eviction by retention


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = "auto"
    # How long a request whose prefix continues below the host tier waits for the reads.
    disk_load_timeout_s: float = 1.0
    # --- smooth streaming: a step budget and fair order (kvtier/scheduler/budget.py, fairness.py) ---
    scheduling_policy: SchedulingPolicy = "stall_free"
    max_step_ms: float = 100.0  # the least target step time; 0: the fixed max_num_batched_tokens budget
    step_time_factor: float = 2.5  # target step time in decode-only steps (grows with queue age)
    step_time_max_factor: float = 0.0  # the most it grows to; 0: MAX_FACTOR_GROWTH x step_time_factor
    max_num_partial_prefills: int = 1  # prompts left mid-prefill at once (0: no limit)
    row_share_span: int = 0  # beside others an n > 1 request decodes 1/span of its rows a step (0: all)
    kv_admission_factor: float = 4.0  # the server's 503 above this many device pools of demand (0: off)
    # --- goodput under overload (kvtier/scheduler/goodput.py) ---
    # Off for the engine alone (an offline batch wants the biggest batch); kvtier serve turns them on.
    max_itl_ms: float = 0.0  # the running batch's step-time target; 0: itl_factor x a lone sequence's step
    itl_factor: float = 0.0  # 0 (with max_itl_ms 0): no cap on the running batch but max_num_seqs
    max_queue_wait_s: float = 0.0  # the server's 503 when a new request would wait longer (0: off)


@dataclass(frozen=True)
class TierConfig:
    """The tiers under the device pool: host memory (``num_host_blocks`` 0: none) and disk."""

    num_host_blocks: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    store_policy: StorePolicy = "write_back"
    secret: bytes | None = field(default=None, repr=False)  # signs blocks below the host tier
    remote_url: str | None = field(default=None, repr=False)  # may hold a password
    remote_policy: StorePolicy = "write_through"
    remote_ttl_s: int = 86400
    write_ahead_blocks: int = 0  # kvtier/kv/write_ahead.py: the pool's next evictions, stored while idle
    layered_loads: bool = False  # host loads slot by slot, each layer waiting for its own (slot_gate.py)


@dataclass(frozen=True)
class EngineConfig:
    """``EngineArgs`` resolved against a model: what the engine builds, and nothing else."""

    model: ModelConfig
    dtype: str  # the compute dtype: "float32", "bfloat16" or "float16" (the KV dtype: cache.kv_dtype)
    cache: CacheConfig
    scheduler: SchedulerConfig
    tiers: TierConfig

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len


def _secret(value: str | None) -> bytes | None:
    """The block-signing secret: the argument, else ``$KVTIER_REMOTE_SECRET``, else none."""
    value = value if value is not None else os.environ.get("KVTIER_REMOTE_SECRET")
    return value.encode("utf-8") if value else None


def _device_pool(args: EngineArgs, model: ModelConfig, block_bytes: int) -> tuple[int, int]:
    """The device pool's blocks, and the longest sequence they hold over the model's KV groups (one
    group: blocks x block_size)."""
    if args.kv_device_blocks is not None:
        num_blocks = args.kv_device_blocks
    else:
        num_blocks = device_pool_blocks(args.kv_device_gb or DEFAULT_KV_DEVICE_GB, block_bytes)
        if num_blocks < 2:
            raise ConfigError(
                f"kv_device_gb={args.kv_device_gb} holds fewer than 2 blocks of {block_bytes} B"
            )
    capacity = model.kv_layout().max_tokens(num_blocks, args.block_size)
    if capacity <= 0:
        raise ConfigError(
            f"{num_blocks} device blocks hold no sequence: each sliding-window KV group keeps up to a "
            "window of blocks besides the full groups' (kvtier/kv/groups.py); raise kv_device_blocks/gb"
        )
    return num_blocks, capacity


def resolve_engine_config(args: EngineArgs, model: ModelConfig) -> EngineConfig:
    """Size the device pool and the tiers in blocks and cap ``max_model_len`` by the pool.

    Pure arithmetic (no torch, no allocation): raises ``ConfigError`` for a pool or tier too small
    to hold a block, or a ``max_model_len`` the pool cannot hold."""
    args.validate()
    dtype = model.native_dtype if args.dtype == "auto" else args.dtype
    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, dtype)
    bs = args.block_size
    block_bytes = kv_block_bytes(model, bs, kv_dtype)
    num_blocks, capacity = _device_pool(args, model, block_bytes)
    if args.max_model_len is not None and args.max_model_len > capacity:
        raise ConfigError(
            f"max_model_len={args.max_model_len} needs more KV than the device pool holds "
            f"({num_blocks} blocks of {bs} tokens hold a sequence of {capacity}); raise kv_device_blocks/gb"
        )
    max_model_len = min(args.max_model_len or model.max_position_embeddings, capacity)
    num_host_blocks = int(args.kv_host_gb * 2**30 // block_bytes)
    if args.kv_host_gb > 0 and num_host_blocks < 1:
        raise ConfigError(f"kv_host_gb={args.kv_host_gb} holds no block of {block_bytes} B")
    return EngineConfig(
        model=model,
        dtype=dtype,
        cache=CacheConfig(
            bs, num_blocks, args.enable_prefix_caching, block_bytes, kv_dtype, args.kv_retain_max_fraction
        ),
        scheduler=SchedulerConfig(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            max_model_len,
            args.preemption_mode,
            scheduling_policy=args.scheduling_policy,
            max_step_ms=args.max_step_ms,
            step_time_factor=args.step_time_factor,
            step_time_max_factor=args.step_time_max_factor,
            max_num_partial_prefills=args.max_num_partial_prefills,
            row_share_span=args.row_share_span,
            kv_admission_factor=args.kv_admission_factor,
            max_itl_ms=args.max_itl_ms,
            itl_factor=args.itl_factor,
            max_queue_wait_s=args.max_queue_wait_s,
        ),
        tiers=TierConfig(
            num_host_blocks,
            args.kv_disk_dir,
            int(args.kv_disk_gb * 2**30),
            args.kv_store_policy,
            _secret(args.kv_remote_secret),
            args.kv_remote_url,
            args.kv_remote_policy,
            int(args.kv_remote_ttl_s),
            _write_ahead_blocks(args, num_host_blocks),
            args.layered_loads,
        ),
    )


def _write_ahead_blocks(args: EngineArgs, num_host_blocks: int) -> int:
    """The device blocks written back ahead of eviction while idle: with a write-back host tier, the
    argument (at most half the host tier: more would evict what it wrote back first, every idle period),
    else one step's worth (kvtier/kv/write_ahead.py)."""
    asked = args.kv_write_ahead_blocks
    if num_host_blocks == 0 or args.kv_store_policy != "write_back":
        if asked:
            raise ConfigError(
                "kv_write_ahead_blocks needs a write_back host tier (kv_host_gb > 0, kv_store_policy "
                "write_back): it writes the device pool's next evictions there"
            )
        return 0
    if asked is not None:
        if asked > num_host_blocks // 2:
            raise ConfigError(
                f"kv_write_ahead_blocks={asked} is more than half the host tier ({num_host_blocks} blocks): "
                "it would evict what it wrote back first"
            )
        return asked
    return write_ahead.default_blocks(args.max_num_batched_tokens, args.block_size, num_host_blocks)


@dataclass
class EngineArgs:
    """Engine arguments: keyword arguments of ``LLM(...)`` and ``--flags`` of the CLI (same names).

    Each field is declared once, here: ``kvtier.args`` turns it into a ``--flag`` (its type from the
    annotation, its help from ``metadata["help"]``) for ``generate``, ``chat``, ``serve`` and the benches.
    """

    model: str | None = field(  # None: the embedded SmolLM2-135M-Instruct GGUF
        default=None,
        metadata={
            "help": "model path: an HF directory or a .gguf file, or gemma-3-270m (the packaged Gemma 3 "
            "270M GGUF) (default: embedded SmolLM2-135M-Instruct)"
        },
    )
    chat_template: str | None = field(  # read and compiled by kvtier.models.loader.read_chat_template
        default=None,
        metadata={
            "help": "chat template replacing the model's: a jinja file, or the template itself (vLLM's "
            "flag; default: the model's own, else its family's, Gemma 3's or Qwen3's)",
            "metavar": "FILE",
        },
    )
    dtype: DType = field(
        default="auto",
        metadata={"help": "auto (the model's own precision), float32 (exact), bfloat16 (fast)"},
    )
    kv_cache_dtype: KVCacheDType = field(
        default="auto",
        metadata={
            "help": "KV cache precision: auto (the compute dtype, exact), bfloat16, fp8_e4m3 (alias fp8), "
            "fp8_e5m2 or int8 (per-token scales; 2-4x the blocks in every tier, docs/kv-dtype.md)"
        },
    )
    weight_dtype: WeightDType = field(
        default="auto",
        metadata={
            "help": "weight precision: auto (dense as loaded; a GGUF dequantized to fp32, exact), gguf (run "
            "the GGUF's own Q8_0/Q4_0/Q4_1 blocks; Q5_0 as Q8_0), int8 (per-channel weight-only int8); "
            "docs/weight-dtype.md"
        },
    )
    attention_backend: AttentionBackend = field(
        default="auto",
        metadata={
            "help": "attention kernels: auto (triton on CUDA, the C decode kernel on a CPU), torch (the "
            "reference path), c, or triton (on a CPU only through its interpreter, TRITON_INTERPRET=1: "
            "slow, for tests); docs/attention-backends.md"
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "never use CUDA graphs: every step launches its kernels from Python (by default on "
            "CUDA, with the triton backend and a model of full-attention layers, decode-shaped steps "
            "replay a graph captured at start: kvtier/worker/graphs.py)"
        },
    )
    layered_loads: bool = field(
        default=False,
        metadata={
            "help": "experimental: a prefix loaded back from the host tier is copied layer by layer and "
            "each layer's attention waits only for its own KV, so the forward runs under the copies "
            "(on CUDA not measured yet: kvtier bench gpu compares it; kvtier/models/slot_gate.py)"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    kv_device_blocks: int | None = field(default=None, metadata={"help": "device KV pool size in blocks"})
    kv_device_gb: float | None = field(
        default=None, metadata={"help": "device KV pool size in GiB (default 1)"}
    )
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "token budget of one step (chunked prefill)"}
    )
    max_model_len: int | None = field(default=None, metadata={"help": "longest prompt + output"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached prompt prefixes"})
    kv_host_gb: float = field(
        default=0.0, metadata={"help": "host-memory KV tier in GiB (0: off); evicted blocks are kept there"}
    )
    kv_disk_dir: str | None = field(
        default=None,
        metadata={"help": "disk KV tier directory (needs --kv-host-gb); persists across restarts"},
    )
    kv_disk_gb: float = field(default=10.0, metadata={"help": "disk KV tier size cap in GiB (default 10)"})
    kv_store_policy: StorePolicy = field(
        default="write_back",
        metadata={"help": "write_back (store blocks when evicted) or write_through (as soon as full)"},
    )
    kv_write_ahead_blocks: int | None = field(
        default=None,
        metadata={
            "help": "with a write_back host tier: how many of the device pool's next evictions are stored "
            "to it while the engine idles, so that the step evicting them copies nothing (default: "
            "max_num_batched_tokens / block_size, at most half the host tier; 0: off)"
        },
    )
    kv_remote_secret: str | None = field(
        default=None,
        metadata={
            "help": "sign blocks stored below the host tier (HMAC-SHA256) and refuse unsigned or forged "
            "ones (default: $KVTIER_REMOTE_SECRET, else none)"
        },
    )
    kv_remote_url: str | None = field(
        default=None,
        metadata={
            "help": "shared remote KV tier under the local ones: redis://[:password@]host:port/db, "
            "rediss:// (TLS), unix://; Valkey alike (needs --kv-host-gb)"
        },
    )
    kv_remote_policy: StorePolicy = field(
        default="write_through",
        metadata={
            "help": "write_through (publish every full block soon after it is computed) or write_back "
            "(only blocks leaving the host tier)"
        },
    )
    kv_remote_ttl_s: float = field(
        default=86400.0,
        metadata={"help": "expiry of every remote value in seconds, refreshed by a hit (0: none)"},
    )
    kv_retain_max_fraction: float = field(
        default=0.5,
        metadata={
            "help": "the most of each tier that prompt-cache retention (cache_control TTLs, "
            "prompt_cache_retention) keeps from eviction, 0..1 (0: retention off)"
        },
    )
    preemption_mode: PreemptionMode = field(
        default="auto", metadata={"help": "auto (cheaper of swap and recompute), swap or recompute"}
    )
    # --- smooth streaming under load (kvtier/scheduler/) ---
    # legacy stays the default: on this 2-core CPU a decode step costs as much as only ~25-50 prompt
    # tokens, so stall_free's smooth streams (ITL p99/p50 2.4x vs 4.7x) cost first tokens (TTFT p90
    # 2.4x legacy's at the TTFT-2 s rate; BENCHMARKS.md, `kvtier bench serve --compare`).
    scheduling_policy: SchedulingPolicy = field(
        default="legacy",
        metadata={
            "help": "legacy (default): the fixed token budget in admission order; stall_free: decodes "
            "first, prefill chunks fill a time budget, priorities and per-tenant fair share (smoother "
            "streams, but slower first tokens on slow CPUs: see BENCHMARKS.md)"
        },
    )
    max_step_ms: float = field(
        default=100.0,
        metadata={
            "help": "the least target step time in ms (stall_free): prefill chunks get what the measured "
            "cost model says fits beside the decodes in max(this, --step-time-factor decode-only steps), "
            "capped by --max-num-batched-tokens (0: the fixed token budget)"
        },
    )
    step_time_factor: float = field(
        default=2.5,
        metadata={
            "help": "stall_free: a step with prompt tokens lasts up to this many measured decode-only "
            "steps (widened while the oldest waiting request queues); 2.5 keeps ITL p99/p50 under 3"
        },
    )
    step_time_max_factor: float = field(
        default=0.0,
        metadata={
            "help": "stall_free: the most --step-time-factor widens to while requests queue (0: 8x it; "
            "equal to it: never wider, streams first however long prompts wait)"
        },
    )
    max_num_partial_prefills: int = field(
        default=1,
        metadata={
            "help": "prompts left mid-prefill at once; prompts that finish within the step overtake, and "
            "one computing at most a quarter of --max-num-batched-tokens gets a short step (0: no limit)"
        },
    )
    row_share_span: int = field(
        default=0,
        metadata={
            "help": "while other requests share the engine, a request with n > 1 rows decodes "
            "max(2, n / this) of them a step, rotating (on a CPU each row costs about a one-row "
            "forward; measured in BENCHMARKS.md, --hostile); 0: every row every step "
            "(default: 0 offline, 8 for kvtier serve)"
        },
    )
    kv_admission_factor: float = field(
        default=4.0,
        metadata={
            "help": "the server answers 503 when running + waiting requests would need more than this "
            "many device KV pools (prompt + max_tokens minus cached blocks; 0: off)"
        },
    )
    max_itl_ms: float = field(
        default=0.0,
        metadata={
            "help": "the running batch grows only while its measured step (wall time between tokens, "
            "prompt chunks included) stays within this many ms, the rest waits in order "
            "(0: --itl-factor x a lone sequence's step)"
        },
    )
    itl_factor: float = field(
        default=0.0,
        metadata={
            "help": "without --max-itl-ms: the step-time target in lone-sequence steps (measured); "
            "0: no cap on the running batch but --max-num-seqs "
            "(default: 0 offline, 10 for kvtier serve)"
        },
    )
    max_queue_wait_s: float = field(
        default=0.0,
        metadata={
            "help": "the server answers 503 (Retry-After) at once when a new request would queue and "
            "its predicted first token (the wait to start, from the running answers' expected ends and "
            "the measured start rate, plus its prompt's measured time up to half this) is later than "
            "this; a request that would start at once is never refused (0: off; default 10 for kvtier "
            "serve)"
        },
    )
    seed: int = field(default=0, metadata={"help": "engine seed (unseeded requests draw from it)"})
    num_threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads", "aliases": ("--threads",)}
    )
    kv_events_url: str | None = field(
        default=None,
        metadata={
            "help": "Redis URL of this replica's KV event stream (blocks stored/removed per medium; "
            "docs/kv-events.md); default: the remote tier's URL when set, else no events"
        },
    )
    canary_rate: float = field(
        default=0.01,
        metadata={
            "help": "equivalence canary: fraction of requests served from cache whose cached K/V is "
            "rechecked against a recomputation when the engine is idle; a mismatch quarantines the "
            "tier it came from (0: off)"
        },
    )
    kv_replica_id: str | None = field(
        default=None,
        metadata={
            "help": "this replica's id in KV events and /v1/kv/info (default: hostname:port under "
            "`kvtier serve`, else hostname:pid)"
        },
    )

    def validate(self) -> None:
        """ConfigError naming the first bad argument (``kvtier.config_checks``)."""
        check_engine_args(self)
