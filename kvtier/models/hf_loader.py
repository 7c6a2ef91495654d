"""Loading an HF-format directory: ``config.json`` + ``*.safetensors`` (+ index when sharded) + tokenizer.

Weights are opened with ``safetensors.safe_open`` (memory-mapped: pages are read when first touched), kept
in the dtype they were stored in, and checked against the config's shapes. This module is on the warm
start-up path: it imports nothing heavier than safetensors (torch comes in through ``safe_open``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from kvtier.config import ConfigError, ModelConfig
from kvtier.hf_config import config_errors, decoder_shape, parse_local_rope, parse_rope, read_json
from kvtier.models.registry import (
    HF_ARCHITECTURES,
    ModelFamily,
    family_of,
    hf_architecture,
    layer_tensor_shapes,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = tuple(HF_ARCHITECTURES)
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_DTYPE_NAMES.update({"half": "float16", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"})
_TORCH_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _id_list(value: Any) -> list[int]:
    """``eos_token_id`` as HF writes it (int, list of ints, or null) as a list."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _native_dtype(cfg: dict[str, Any]) -> str | None:
    """The published precision from ``dtype`` / ``torch_dtype``, or None when the config does not say."""
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ConfigError(f"unsupported checkpoint dtype {name!r} (supported: float32, bfloat16, float16)")
    return _DTYPE_NAMES[name]


def _max_positions(cfg: dict[str, Any], arch: str, family: ModelFamily) -> int:
    """Context length. The llama family runs no sliding window: a window caps its context so that
    attention stays exact (Mistral, Qwen2 with ``use_sliding_window``)."""
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
    if family.name == "llama" and uses_window and isinstance(window, int) and 0 < window < max_pos:
        return window
    return max_pos


def _layer_types(cfg: dict[str, Any], family: ModelFamily, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind: ``layer_types`` when config.json has it, else Gemma 3's
    ``sliding_window_pattern`` (every n-th layer full) or Qwen3's ``max_window_layers`` rule."""
    if family.name == "llama":
        return ()  # every layer full (a window caps the context instead: _max_positions)
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return tuple(str(t) for t in types)
    if family.name == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        )
    first = int(cfg.get("max_window_layers", num_layers))  # qwen3: layers from here on slide
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))


def _attention_fields(
    cfg: dict[str, Any], family: ModelFamily, num_layers: int, max_pos: int
) -> dict[str, Any]:
    """ModelConfig's ``layer_types`` and ``sliding_window``: every layer full without a window (Qwen3
    slides only with ``use_sliding_window``); a window of at least the context is clamped to it."""
    window = cfg.get("sliding_window")
    if family.name == "qwen3" and not cfg.get("use_sliding_window", False):
        window = None
    if family.name == "gemma3" and window is None:  # HF: no window, but sliding layers keep the local RoPE
        window = max_pos
    types = _layer_types(cfg, family, num_layers)
    if window is None or "sliding_attention" not in types:  # no window: a sliding layer sees everything
        full = tuple("full_attention" if t == "sliding_attention" else t for t in types)
        return {"layer_types": full, "sliding_window": None}
    window = int(window)
    if window > max_pos:
        logger.info("kvtier: sliding_window %d exceeds the %d-token context; clamped to it", window, max_pos)
        window = max_pos
    return {"layer_types": types, "sliding_window": window}


def _family_fields(cfg: dict[str, Any], family: ModelFamily) -> dict[str, Any]:
    """ModelConfig fields a family reads beyond llama's (Gemma 3: local RoPE base, attention scale,
    logit softcap); ConfigError for Gemma 3 options kvtier does not run."""
    if family.name != "gemma3":
        return {}
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError("unsupported attn_logit_softcapping (kvtier runs Gemma 3 without it)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("unsupported use_bidirectional_attention (kvtier runs causal decoders)")
    cap = cfg.get("final_logit_softcapping")
    return {
        "rope_local_theta": parse_local_rope(cfg),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "final_logit_softcapping": None if cap is None else float(cap),
    }


def _check_activation(cfg: dict[str, Any], family: ModelFamily) -> None:
    key = "hidden_activation" if family.name == "gemma3" else "hidden_act"
    act = cfg.get(key) or family.activation
    if act != family.activation:
        raise ConfigError(f"unsupported activation {act!r} (kvtier runs {family.activation}-gated MLPs here)")


def parse_config(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ModelConfig:
    """A ``ModelConfig`` from an HF ``config.json`` dict (and ``generation_config.json`` for eos/bos)."""
    arch = hf_architecture(cfg)
    family = family_of(arch)
    _check_activation(cfg, family)
    with config_errors("config.json"):
        shape = decoder_shape(cfg)
        theta, scaling = parse_rope(cfg)
        generation_cfg = generation_cfg or {}
        eos = _id_list(cfg.get("eos_token_id")) + _id_list(generation_cfg.get("eos_token_id"))
        bos = cfg.get("bos_token_id", generation_cfg.get("bos_token_id"))
        max_pos = _max_positions(cfg, arch, family)
        config = ModelConfig(
            **dataclasses.asdict(shape),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            native_dtype=_native_dtype(cfg) or "float32",
            family=family.name,
            **_attention_fields(cfg, family, shape.num_layers, max_pos),
            **_family_fields(cfg, family),
        )
    return config


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the engine reads, HF-named, with its shape. Biases are listed as optional elsewhere."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q, inter = config.num_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)  # [out, in]
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes.update(layer_tensor_shapes(config))  # q/k norms, Gemma 3's feed-forward norms
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def optional_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Bias tensors, kept when the checkpoint has them (Qwen2 has q/k/v biases but no o_proj bias)."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q, inter = config.num_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)):
            shapes[f"{p}self_attn.{name}.bias"] = (size,)
        for name, size in (("gate_proj", inter), ("up_proj", inter), ("down_proj", h)):
            shapes[f"{p}mlp.{name}.bias"] = (size,)
    return shapes


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: from ``model.safetensors.index.json`` or by globbing."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        if missing := [f.name for f in files if not f.is_file()]:
            raise ConfigError(f"{path} is missing weight shards: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {', '.join(sorted(other))}: only safetensors is supported)" if other else ""
        raise ConfigError(f"no *.safetensors weights in {path}{hint}")
    return files


def load_weights(path: Path, config: ModelConfig, files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name, memory-mapped, as stored; shapes checked against ``config``.
    ``files``: the safetensors to read (default: ``safetensors_files(path)``)."""
    required, optional = expected_shapes(config), optional_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in files if files is not None else safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 -- safe_open objects are not iterable
                    if name in required or name in optional:
                        weights[name] = f.get_tensor(name)
        except ConfigError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError / OSError on corrupt files
            raise ConfigError(f"cannot read weights from {file}: {exc}") from exc
    if missing := [name for name in required if name not in weights]:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConfigError(f"checkpoint {path} is missing {', '.join(missing[:3])}{more}")
    for name, tensor in weights.items():
        want = required.get(name) or optional[name]
        if tuple(tensor.shape) != want:
            raise ConfigError(f"{name} has shape {tuple(tensor.shape)} but config.json implies {want}")
    return weights


def stored_dtype(weights: dict[str, torch.Tensor]) -> str:
    """The precision of the large matrices (what the checkpoint was published in)."""
    tensor = weights["model.embed_tokens.weight"]
    return _TORCH_DTYPE_NAMES.get(str(tensor.dtype), "float32")


def load_config(path: Path) -> tuple[dict[str, Any], ModelConfig]:
    """Raw ``config.json`` dict and the parsed ``ModelConfig`` (eos merged with generation_config.json)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"no config.json in {path}")
    raw = read_json(config_file)
    gen_file = path / "generation_config.json"
    generation = read_json(gen_file) if gen_file.is_file() else None
    return raw, parse_config(raw, generation)
