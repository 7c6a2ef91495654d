"""Reading an HF model's JSON files: ``read_json``, a decoder's shape and its RoPE. No torch.

Two readers of ``config.json`` share this module, and keep their own rules on top of it::

    hf_loader.parse_config   -> ModelConfig   the loader: refuses what the engine cannot run
                                              (architecture, activation, rope type), adds norms,
                                              biases, special ids, dtype, layer types and window,
                                              Gemma 3's local RoPE base (``parse_local_rope``)
    planner_presets.hf_spec  -> ModelSpec     the planner: any decoder (Qwen3, multimodal text
                                              configs...), adds the parameter count, qk-norm, and
                                              the layer types and window (``layer_kinds``)

Both take the shape (``decoder_shape``) and turn a missing key or a bad value into one ``ConfigError``
naming the file (``config_errors``). The tokenizer reads its JSON files with ``read_json`` too.
``layer_kinds`` states the loader's rules for each layer's attention kind (``hf_loader._layer_types``
and ``_attention_fields``, which the planner's tests hold it to).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError

SUPPORTED_ROPE_TYPES = ("llama3", "linear")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ConfigError when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


@contextlib.contextmanager
def config_errors(where: str) -> Iterator[None]:
    """Inside the block, a missing key or a bad value (KeyError, TypeError, ValueError, a zero head
    count) becomes a ConfigError naming ``where``; a ConfigError passes unchanged."""
    try:
        yield
    except ConfigError:
        raise
    except KeyError as exc:
        raise ConfigError(f"{where} is missing {exc.args[0]!r}") from exc
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(f"{where} has an invalid value: {exc}") from exc


@dataclass(frozen=True)
class DecoderShape:
    """A decoder's sizes, with the field names of ``ModelConfig`` and ``ModelSpec``."""

    num_layers: int
    num_heads: int
    num_kv_heads: int  # ``num_key_value_heads``, else ``num_heads`` (no GQA)
    head_dim: int  # ``head_dim``, else hidden_size / num_heads
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool


def decoder_shape(cfg: dict[str, Any]) -> DecoderShape:
    """The shape of a ``config.json`` dict; raises KeyError / ValueError as read (see ``config_errors``)."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return DecoderShape(
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5).

    The scaling dict is normalised to HF's form with a ``rope_type`` key ("llama3" or "linear"); the default
    rope gives None. Other types (yarn, dynamic, longrope...) are a ConfigError.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form: take full attention
        params = params["full_attention"]
    scaling = cfg.get("rope_scaling") or (params if isinstance(params, dict) else None)
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    theta = float(theta) if theta is not None else 10000.0
    if not isinstance(scaling, dict):
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "rope_type")}
    if "factor" not in out:
        raise ConfigError(f"rope scaling {rope_type!r} needs a 'factor'")
    required = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if rope_type == "llama3" and (missing := [k for k in required if k not in out]):
        raise ConfigError(f"llama3 rope scaling is missing {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **out}


def parse_local_rope(cfg: dict[str, Any]) -> float:
    """The RoPE base of sliding-window layers (Gemma 3): ``rope_parameters["sliding_attention"]``
    (transformers 5), else ``rope_local_base_freq`` (4), else 10000. Scaling there is a ConfigError."""
    params = cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        rope_type = local.get("rope_type", local.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ConfigError(
                f"unsupported rope type {rope_type!r} for sliding_attention layers (supported: default)"
            )
        if local.get("rope_theta") is not None:
            return float(local["rope_theta"])
    return float(cfg.get("rope_local_base_freq") or 10000.0)


_FULL, _SLIDING = "full_attention", "sliding_attention"


def layer_kinds(
    cfg: dict[str, Any], family: str, num_layers: int, max_positions: int
) -> tuple[tuple[str, ...], int | None]:
    """``(layer_types, sliding_window)`` of a decoder that the engine runs as ``family`` ("llama",
    "qwen3" or "gemma3"), by the loader's rules; ``((), None)`` when every layer is full attention.

    * llama (Llama, Mistral, Qwen2): every layer full (a window caps the context instead).
    * ``layer_types`` when config.json has it; else Gemma 3's ``sliding_window_pattern`` (every n-th
      layer full, 6 by default) or Qwen3's ``max_window_layers`` (layers from there on slide).
    * Qwen3 slides only with ``use_sliding_window``; Gemma 3 without a window slides over the whole
      context. A window past ``max_positions`` is clamped to it.
    """
    window = cfg.get("sliding_window")
    if family == "llama" or (family == "qwen3" and not cfg.get("use_sliding_window", False)):
        return (), None
    if family == "gemma3" and window is None:
        window = max_positions
    types = cfg.get("layer_types")
    if isinstance(types, list):
        kinds = tuple(str(t) for t in types)
    elif family == "gemma3":
        period = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        kinds = tuple(_SLIDING if (i + 1) % period else _FULL for i in range(num_layers))
    else:
        first = int(cfg.get("max_window_layers", num_layers))
        kinds = tuple(_SLIDING if i >= first else _FULL for i in range(num_layers))
    if window is None or _SLIDING not in kinds:
        return (), None
    return kinds, min(int(window), max_positions)
