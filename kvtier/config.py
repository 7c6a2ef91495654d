"""Frozen configuration records, and how user arguments resolve into them.

Each record is owned by one layer of the engine:

* ``ModelConfig``     — the architecture, read from a model's files by ``kvtier.models.loader``.
* ``CacheConfig``     — the device block pool (block size, how many blocks, prefix caching).
* ``SchedulerConfig`` — continuous batching limits (token budget, sequences per step, model length).
* ``TierConfig``      — the tiers under the device pool (host memory, disk) and their sizes.
* ``EngineArgs``      — what a user passes to ``LLM(...)`` or the CLI.

``resolve_engine_config(args, model)`` turns ``EngineArgs`` and a ``ModelConfig`` into an
``EngineConfig`` holding the other records: pool sizes in blocks, the capped ``max_model_len``. It is
the single source of truth the engine builds from. Nothing here imports torch, so the scheduler side
and its tests stay torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
PreemptionMode = Literal["auto", "swap", "recompute"]
StorePolicy = Literal["write_back", "write_through"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_KV_DEVICE_GB = 1.0


class ConfigError(ValueError):
    """A user-facing configuration or input error (printed as one line by the CLI, a 400 by the API)."""


def check_choice(name: str, value: object, choices: Any) -> None:
    """Raise ``ConfigError`` unless ``value`` is one of a ``Literal`` type's values (or a sequence)."""
    allowed = typing.get_args(choices) or tuple(choices)
    if value not in allowed:
        listed = ", ".join(str(c) for c in allowed[:-1]) + f" or {allowed[-1]}"
        raise ConfigError(f"{name} must be {listed}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, SmolLM, TinyLlama, Qwen2-style biases)."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, at 4 bytes per element (fp32)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: str) -> int:
    """Bytes of one KV block: K and V of ``block_size`` tokens in every layer, in ``dtype``."""
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_device_blocks: int = 0
    enable_prefix_caching: bool = True
    block_bytes: int = 0  # bytes of one block in the device pool (and in every tier)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = "auto"
    # How long a request whose prefix continues below the host tier waits for the reads.
    disk_load_timeout_s: float = 1.0


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


@dataclass(frozen=True)
class EngineConfig:
    """``EngineArgs`` resolved against a model: what the engine builds, and nothing else."""

    model: ModelConfig
    dtype: str  # the compute and KV dtype: "float32", "bfloat16" or "float16"
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


def resolve_engine_config(args: EngineArgs, model: ModelConfig) -> EngineConfig:
    """Size the device pool and the tiers in blocks and cap ``max_model_len`` by the pool.

    Pure arithmetic (no torch, no allocation): raises ``ConfigError`` for a pool or tier too small
    to hold a block, or a ``max_model_len`` the pool cannot hold."""
    args.validate()
    dtype = model.native_dtype if args.dtype == "auto" else args.dtype
    bs = args.block_size
    block_bytes = kv_block_bytes(model, bs, dtype)
    if args.kv_device_blocks is not None:
        num_blocks = args.kv_device_blocks
    else:
        num_blocks = int((args.kv_device_gb or DEFAULT_KV_DEVICE_GB) * 2**30 // block_bytes)
        if num_blocks < 2:
            raise ConfigError(
                f"kv_device_gb={args.kv_device_gb} holds fewer than 2 blocks of {block_bytes} B"
            )
    capacity = num_blocks * bs
    if args.max_model_len is not None and args.max_model_len > capacity:
        raise ConfigError(
            f"max_model_len={args.max_model_len} needs more KV than the device pool holds "
            f"({num_blocks} blocks x {bs} = {capacity} tokens); raise kv_device_blocks/gb"
        )
    max_model_len = min(args.max_model_len or model.max_position_embeddings, capacity)
    num_host_blocks = int(args.kv_host_gb * 2**30 // block_bytes)
    if args.kv_host_gb > 0 and num_host_blocks < 1:
        raise ConfigError(f"kv_host_gb={args.kv_host_gb} holds no block of {block_bytes} B")
    return EngineConfig(
        model=model,
        dtype=dtype,
        cache=CacheConfig(bs, num_blocks, args.enable_prefix_caching, block_bytes),
        scheduler=SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, max_model_len, args.preemption_mode
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
        ),
    )


@dataclass
class EngineArgs:
    """Engine arguments: keyword arguments of ``LLM(...)`` and ``--flags`` of the CLI (same names)."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: DType = "auto"
    block_size: int = 16
    kv_device_blocks: int | None = None
    kv_device_gb: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_host_gb: float = 0.0  # host-memory tier (L2); 0 disables it
    kv_disk_dir: str | None = None  # disk tier (L3) directory; None disables it
    kv_disk_gb: float = 10.0  # disk tier size cap
    kv_store_policy: StorePolicy = "write_back"
    # Signs blocks written below the host tier (HMAC-SHA256) and refuses unsigned or forged ones on
    # read (disk, and a shared remote store); default: $KVTIER_REMOTE_SECRET, else none.
    kv_remote_secret: str | None = None
    # Remote tier (L4) shared by replicas: redis://[:password@]host:port/db, rediss:// (TLS), Valkey alike.
    kv_remote_url: str | None = None
    kv_remote_policy: StorePolicy = "write_through"
    kv_remote_ttl_s: float = 86400.0  # expiry of every stored value, refreshed by a hit; 0: none
    preemption_mode: PreemptionMode = "auto"
    seed: int = 0
    num_threads: int | None = None
    # Extra fields for later tiers/servers are added here, each with a default.
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_device_blocks is not None and self.kv_device_blocks < 2:
            raise ConfigError(f"kv_device_blocks must be at least 2, got {self.kv_device_blocks}")
        for name in ("kv_device_gb", "kv_host_gb", "kv_disk_gb"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
        if self.kv_device_gb is not None and self.kv_device_gb <= 0:
            raise ConfigError(f"kv_device_gb must be positive, got {self.kv_device_gb}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.kv_host_gb < 0:
            raise ConfigError(f"kv_host_gb must be >= 0, got {self.kv_host_gb}")
        if self.kv_disk_gb <= 0:
            raise ConfigError(f"kv_disk_gb must be positive, got {self.kv_disk_gb}")
        if self.kv_disk_dir is not None and self.kv_host_gb <= 0:
            raise ConfigError(
                "kv_disk_dir needs kv_host_gb > 0: disk blocks are read back through host memory"
            )
        if self.kv_store_policy not in ("write_back", "write_through"):
            raise ConfigError(
                f"kv_store_policy must be write_back or write_through, got {self.kv_store_policy!r}"
            )
        self._validate_remote()
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ConfigError(
                f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    def _validate_remote(self) -> None:
        check_choice("kv_remote_policy", self.kv_remote_policy, StorePolicy)
        ttl = self.kv_remote_ttl_s
        if not isinstance(ttl, int | float) or not math.isfinite(ttl) or ttl < 0 or ttl != int(ttl):
            raise ConfigError(f"kv_remote_ttl_s must be a whole number of seconds >= 0, got {ttl!r}")
        url = self.kv_remote_url
        if url is None:
            return
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(
                f"kv_remote_url must be a redis://, rediss:// or unix:// URL, got {_without_password(url)!r}"
            )
        if self.kv_host_gb <= 0:
            raise ConfigError(
                "kv_remote_url needs kv_host_gb > 0: remote blocks are read through host memory"
            )


def _without_password(url: str) -> str:
    """``url`` for an error message: a password in it is not repeated."""
    head, sep, tail = url.rpartition("@")
    return f"{head.split('://', 1)[0]}://***@{tail}" if sep else url
