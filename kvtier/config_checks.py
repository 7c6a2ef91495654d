"""Checking ``EngineArgs`` before anything loads: ``check_engine_args`` raises ``ConfigError`` naming
the first bad argument (``EngineArgs.validate`` calls it). Fields with a ``Literal`` type or a float are
checked from their annotations; the rest by the rules below, one group of arguments per function."""

from __future__ import annotations

import math
import typing
from typing import TYPE_CHECKING, Any, Literal

from kvtier.kv_events import check_replica_id

if TYPE_CHECKING:
    from kvtier.config import EngineArgs

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class ConfigError(ValueError):
    """A user-facing configuration or input error (printed as one line by the CLI, a 400 by the API)."""


def check_choice(name: str, value: object, choices: Any) -> None:
    """Raise ``ConfigError`` unless ``value`` is one of a ``Literal`` type's values (or a sequence)."""
    allowed = typing.get_args(choices) or tuple(choices)
    if value not in allowed:
        listed = ", ".join(str(c) for c in allowed[:-1]) + f" or {allowed[-1]}"
        raise ConfigError(f"{name} must be {listed}, got {value!r}")


def check_engine_args(args: EngineArgs) -> None:
    """ConfigError naming the first bad argument (fields with a ``Literal`` type or a float are
    checked from their annotation)."""
    hints = typing.get_type_hints(type(args))
    if args.block_size <= 0 or args.block_size & (args.block_size - 1):
        raise ConfigError(f"block_size must be a positive power of two, got {args.block_size}")
    if args.kv_device_blocks is not None and args.kv_device_blocks < 2:
        raise ConfigError(f"kv_device_blocks must be at least 2, got {args.kv_device_blocks}")
    for name, hint in hints.items():
        value = getattr(args, name)
        if float in (hint, *typing.get_args(hint)) and value is not None and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
    if args.kv_device_gb is not None and args.kv_device_gb <= 0:
        raise ConfigError(f"kv_device_gb must be positive, got {args.kv_device_gb}")
    if args.max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be at least 1, got {args.max_num_seqs}")
    if args.max_num_batched_tokens < 1:
        raise ConfigError(f"max_num_batched_tokens must be at least 1, got {args.max_num_batched_tokens}")
    _check_scheduling(args)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ConfigError(f"max_model_len must be at least 1, got {args.max_model_len}")
    if not 0.0 <= args.canary_rate <= 1.0:
        raise ConfigError(f"canary_rate must be in [0, 1], got {args.canary_rate}")
    if args.kv_host_gb < 0:
        raise ConfigError(f"kv_host_gb must be >= 0, got {args.kv_host_gb}")
    if args.kv_write_ahead_blocks is not None and args.kv_write_ahead_blocks < 0:
        raise ConfigError(f"kv_write_ahead_blocks must be >= 0, got {args.kv_write_ahead_blocks}")
    if args.kv_disk_gb <= 0:
        raise ConfigError(f"kv_disk_gb must be positive, got {args.kv_disk_gb}")
    if args.kv_disk_dir is not None and args.kv_host_gb <= 0:
        raise ConfigError("kv_disk_dir needs kv_host_gb > 0: disk blocks are read back through host memory")
    if args.layered_loads and args.kv_host_gb <= 0:
        raise ConfigError("layered_loads needs kv_host_gb > 0: it changes how host-tier blocks are loaded")
    for name, hint in hints.items():
        if typing.get_origin(hint) is Literal:
            check_choice(name, getattr(args, name), hint)
    if args.kv_events_url is not None and not args.kv_events_url.startswith(_REDIS_SCHEMES):
        raise ConfigError(
            f"kv_events_url must be a redis://, rediss:// or unix:// URL, got {args.kv_events_url!r}"
        )
    if args.kv_replica_id is not None:
        try:
            check_replica_id(args.kv_replica_id)
        except ValueError as exc:
            raise ConfigError(f"kv_replica_id: {exc}") from None
    _check_remote(args)
    _check_weight_dtype(args)


def _check_weight_dtype(args: EngineArgs) -> None:
    if args.weight_dtype != "auto" and args.dtype not in ("auto", "float32"):
        raise ConfigError(
            f"weight_dtype={args.weight_dtype} computes in float32 (its kernels take fp32 activations); "
            f"use dtype=auto or float32, not {args.dtype}"
        )


def _check_scheduling(args: EngineArgs) -> None:
    if args.max_step_ms < 0:
        raise ConfigError(f"max_step_ms must be >= 0, got {args.max_step_ms}")
    if args.step_time_factor != 0 and args.step_time_factor < 1:
        raise ConfigError(f"step_time_factor must be 0 or >= 1, got {args.step_time_factor}")
    if args.step_time_max_factor != 0 and args.step_time_max_factor < args.step_time_factor:
        raise ConfigError(
            f"step_time_max_factor must be 0 or >= step_time_factor ({args.step_time_factor}), "
            f"got {args.step_time_max_factor}"
        )
    if args.row_share_span < 0:
        raise ConfigError(f"row_share_span must be >= 0, got {args.row_share_span}")
    if args.max_num_partial_prefills < 0:
        raise ConfigError(f"max_num_partial_prefills must be >= 0, got {args.max_num_partial_prefills}")
    if not 0.0 <= args.kv_retain_max_fraction <= 1.0:
        raise ConfigError(f"kv_retain_max_fraction must be in [0, 1], got {args.kv_retain_max_fraction}")
    if args.kv_admission_factor < 0:
        raise ConfigError(f"kv_admission_factor must be >= 0, got {args.kv_admission_factor}")
    for name in ("max_itl_ms", "itl_factor", "max_queue_wait_s"):
        if getattr(args, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(args, name)}")
    if 0 < args.itl_factor < 1:
        raise ConfigError(f"itl_factor must be 0 or >= 1, got {args.itl_factor}")


def _check_remote(args: EngineArgs) -> None:
    ttl = args.kv_remote_ttl_s
    if not isinstance(ttl, int | float) or not math.isfinite(ttl) or ttl < 0 or ttl != int(ttl):
        raise ConfigError(f"kv_remote_ttl_s must be a whole number of seconds >= 0, got {ttl!r}")
    url = args.kv_remote_url
    if url is None:
        return
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"kv_remote_url must be a redis://, rediss:// or unix:// URL, got {_without_password(url)!r}"
        )
    if args.kv_host_gb <= 0:
        raise ConfigError("kv_remote_url needs kv_host_gb > 0: remote blocks are read through host memory")


def _without_password(url: str) -> str:
    """``url`` for an error message: a password in it is not repeated."""
    head, sep, tail = url.rpartition("@")
    return f"{head.split('://', 1)[0]}://***@{tail}" if sep else url
