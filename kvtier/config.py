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
import typing
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
    """Engine arguments: keyword arguments of ``LLM(...)`` and ``--flags`` of the CLI (same names).

    Each field is declared once, here: ``kvtier.args`` turns it into a ``--flag`` (its type from the
    annotation, its help from ``metadata["help"]``) for ``generate``, ``chat``, ``serve`` and the benches.
    """

    model: str | None = field(  # None: the embedded SmolLM2-135M-Instruct GGUF
        default=None,
        metadata={
            "help": "model path: an HF directory or a .gguf file (default: embedded SmolLM2-135M-Instruct)"
        },
    )
    dtype: DType = field(
        default="auto",
        metadata={"help": "auto (the model's own precision), float32 (exact), bfloat16 (fast)"},
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
    preemption_mode: PreemptionMode = field(
        default="auto", metadata={"help": "auto (cheaper of swap and recompute), swap or recompute"}
    )
    seed: int = field(default=0, metadata={"help": "engine seed (unseeded requests draw from it)"})
    num_threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads", "aliases": ("--threads",)}
    )

    def validate(self) -> None:
        """ConfigError naming the first bad argument (fields with a ``Literal`` type or a float are
        checked from their annotation)."""
        hints = typing.get_type_hints(EngineArgs)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_device_blocks is not None and self.kv_device_blocks < 2:
            raise ConfigError(f"kv_device_blocks must be at least 2, got {self.kv_device_blocks}")
        for name, hint in hints.items():
            value = getattr(self, name)
            if float in (hint, *typing.get_args(hint)) and value is not None and not math.isfinite(value):
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
        for name, hint in hints.items():
            choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
            if choices and getattr(self, name) not in choices:
                allowed = ", ".join(choices[:-1]) + " or " + choices[-1]
                raise ConfigError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
