"""Frozen configuration records.

Each record is owned by one layer of the engine:

* ``ModelConfig``     — the architecture, read from a model's files by ``kvtier.models.loader``.
* ``CacheConfig``     — the device block pool (block size, how many blocks, prefix caching).
* ``SchedulerConfig`` — continuous batching limits (token budget, sequences per step, model length).
* ``EngineArgs``      — what a user passes to ``LLM(...)`` or the CLI; resolved into the three above.

Nothing here imports torch, so the scheduler side and its tests stay torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
PreemptionMode = Literal["auto", "swap", "recompute"]
StorePolicy = Literal["write_back", "write_through"]


class ConfigError(ValueError):
    """A user-facing configuration or input error (printed as one line by the CLI, a 400 by the API)."""


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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_device_blocks: int = 0  # resolved by the engine from kv_device_blocks / kv_device_gb
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = "auto"
    # How long a request whose prefix continues on disk waits for the reads before computing it.
    disk_load_timeout_s: float = 1.0


@dataclass(frozen=True)
class TierConfig:
    """The tiers under the device pool: host memory (``host_gb`` 0 disables it) and disk."""

    host_gb: float = 0.0
    disk_dir: str | None = None
    disk_gb: float = 10.0
    store_policy: StorePolicy = "write_back"


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
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ConfigError(
                f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
