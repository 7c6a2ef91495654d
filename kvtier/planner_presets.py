"""Where ``kvtier plan`` gets a model's architecture numbers: presets, HF ``config.json``, GGUF headers.

Each returns ``kvtier.planner.ModelSpec`` keyword arguments. Nothing here loads weights or imports torch.

* ``PRESETS``: the published ``config.json`` numbers of well-known decoders (``--model llama-3.1-8b``). Their
  parameter counts are derived by ``kvtier.planner.count_params`` and match the published safetensors totals
  exactly (the tests pin them). Gemma 3 carries each layer's attention kind and its window (every 6th
  layer full, the others a sliding window), as ``layer_types`` and ``sliding_window`` in HF's names.
* ``hf_spec``: an HF ``config.json`` (+ the safetensors headers beside it for the exact parameter count).
* ``gguf_spec``: a GGUF file's metadata and tensor table, read straight from its header.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError
from kvtier.hf_config import config_errors, decoder_shape, layer_kinds, read_json

GEMMA3_FULL_EVERY = 6  # Gemma 3: layer i is full attention when (i + 1) % 6 == 0, else sliding


def gemma3_layers(num_layers: int, window: int) -> dict[str, Any]:
    """A Gemma 3 preset's attention: ``layer_types`` (every 6th layer full) and ``sliding_window``; the
    q/k norms and the norms after attention and MLP (4 RMSNorms a layer) for the parameter count."""
    kinds = ("sliding_attention",) * (GEMMA3_FULL_EVERY - 1) + ("full_attention",)
    layer_types = tuple(kinds[i % GEMMA3_FULL_EVERY] for i in range(num_layers))
    return dict(layer_types=layer_types, sliding_window=window, qk_norm=True, sandwich_norm=True)


# name -> ModelSpec keyword arguments (everything except the derived parameter count). Gemma 3 4B/12B/27B
# are multimodal checkpoints: the numbers are their ``text_config``'s (the SigLIP vision tower, ~0.4 B
# parameters, is not counted). Qwen3's published configs slide nowhere (``use_sliding_window: false``).
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M(-Instruct): the embedded default model
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_context=8192,
    ),
    "llama-3.2-1b": dict(
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, hidden_size=2048,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_context=131072,
    ),
    "llama-3.2-3b": dict(
        num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128, hidden_size=3072,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_context=131072,
    ),
    "mistral-7b": dict(  # mistralai/Mistral-7B-v0.3
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
        intermediate_size=14336, vocab_size=32768, max_context=32768,
    ),
    "llama-3.1-8b": dict(
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
        intermediate_size=14336, vocab_size=128256, max_context=131072,
    ),
    "qwen3-8b": dict(  # the capacity model's 8B-class example: 147,456 KV bytes/token at 16 bits
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
        intermediate_size=12288, vocab_size=151936, qk_norm=True, max_context=40960,
    ),
    "qwen3-32b": dict(
        num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128, hidden_size=5120,
        intermediate_size=25600, vocab_size=151936, qk_norm=True, max_context=40960,
    ),
    "gemma-3-270m": dict(  # = the sum of gemma-3-270m GGUF's tensors (268,098,176)
        num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, hidden_size=640,
        intermediate_size=2048, vocab_size=262144, tie_word_embeddings=True, max_context=32768,
        **gemma3_layers(18, window=512),
    ),
    "gemma-3-1b": dict(
        num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, hidden_size=1152,
        intermediate_size=6912, vocab_size=262144, tie_word_embeddings=True, max_context=32768,
        **gemma3_layers(26, window=512),
    ),
    "gemma-3-4b": dict(
        num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256, hidden_size=2560,
        intermediate_size=10240, vocab_size=262208, tie_word_embeddings=True, max_context=131072,
        **gemma3_layers(34, window=1024),
    ),
    "gemma-3-12b": dict(
        num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, hidden_size=3840,
        intermediate_size=15360, vocab_size=262208, tie_word_embeddings=True, max_context=131072,
        **gemma3_layers(48, window=1024),
    ),
    "gemma-3-27b": dict(
        num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128, hidden_size=5376,
        intermediate_size=21504, vocab_size=262208, tie_word_embeddings=True, max_context=131072,
        **gemma3_layers(62, window=1024),
    ),
    "llama-3.1-70b": dict(
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, hidden_size=8192,
        intermediate_size=28672, vocab_size=128256, max_context=131072,
    ),
    "llama-3.1-405b": dict(
        num_layers=126, num_heads=128, num_kv_heads=8, head_dim=128, hidden_size=16384,
        intermediate_size=53248, vocab_size=128256, max_context=131072,
    ),
}  # fmt: skip


def hf_spec(config_path: Path) -> dict[str, Any]:
    """ModelSpec keywords from an HF ``config.json`` (its ``text_config`` for a multimodal config). The
    parameter count is summed from the safetensors headers beside it, else left to the planner (0).
    Any decoder is read; Gemma 3 and Qwen3 also with each layer's attention kind and the window, by
    the loader's rules (``kvtier.hf_config.layer_kinds``), every other one as all full attention."""
    outer = read_json(config_path)
    cfg = outer.get("text_config") if isinstance(outer.get("text_config"), dict) else outer
    family = _family(str(cfg.get("model_type") or outer.get("model_type") or ""))
    params = _safetensors_params(config_path.parent)
    with config_errors(str(config_path)):
        shape = decoder_shape(cfg)
        max_context = int(cfg["max_position_embeddings"]) if cfg.get("max_position_embeddings") else None
        layer_types, window = layer_kinds(cfg, family, shape.num_layers, max_context or 2048)
    return dict(
        name=config_path.resolve().parent.name,
        **dataclasses.asdict(shape),
        num_params=params,
        qk_norm=family in ("qwen3", "gemma3"),
        sandwich_norm=family == "gemma3",
        layer_types=layer_types,
        sliding_window=window,
        max_context=max_context,
        source="hf",
    )


def _family(model_type: str) -> str:
    """The engine's model family of an HF ``model_type`` (``kvtier.hf_config.layer_kinds``'s names)."""
    if model_type in ("gemma3", "gemma3_text"):
        return "gemma3"
    return "qwen3" if model_type == "qwen3" else "llama"


def _safetensors_params(directory: Path) -> int:
    """Total elements of the checkpoint's tensors, read from the safetensors headers only; 0 when there are
    no (complete) safetensors weights. Shards come from ``model.safetensors.index.json`` when it exists."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(read_json(index)["weight_map"].values())
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"cannot read {index}: {exc}") from exc
    else:  # Mistral's consolidated.safetensors repeats the HF shards
        names = {f.name for f in directory.glob("*.safetensors") if not f.name.startswith("consolidated")}
    files = [directory / name for name in sorted(names)]
    if not all(f.is_file() for f in files):
        return 0
    total = 0
    for file in files:
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise ConfigError(f"cannot read the safetensors header of {file}: {exc}") from exc
    return total


# GGUF value type -> struct format (8 is a string, 9 an array)
_GGUF_SCALARS = {k: "<" + c for k, c in zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True)}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
    """``(metadata, array lengths, elements of each tensor)`` of a GGUF v2/v3 file, reading only its header.

    String arrays (the tokenizer's tokens and merges) are skipped, not decoded: ``metadata`` holds scalars,
    strings and numeric arrays; ``array lengths`` holds the length of every array. This walks the layout
    ``gguf.GGUFReader`` reads, ~50x faster (GGUFReader spends seconds decoding the vocabulary).
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ConfigError(f"{path} is not a GGUF file")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version < 2:
                raise ConfigError(f"{path}: GGUF version {version} is too old (2 or later is supported)")
            pos, meta, lengths = 24, {}, {}

            def string(pos: int) -> tuple[str, int]:
                (n,) = struct.unpack_from("<Q", buf, pos)
                return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n

            def value(kind: int, pos: int, key: str) -> tuple[Any, int]:
                if kind in _GGUF_SCALARS:
                    fmt = _GGUF_SCALARS[kind]
                    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
                if kind == _GGUF_STRING:
                    return string(pos)
                if kind != _GGUF_ARRAY:
                    raise ConfigError(f"{path}: unknown GGUF value type {kind} for {key}")
                item, count = struct.unpack_from("<IQ", buf, pos)
                lengths[key] = count
                pos += 12
                if item in _GGUF_SCALARS:
                    fmt = _GGUF_SCALARS[item]
                    end = pos + count * struct.calcsize(fmt)
                    return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)), end
                for _ in range(count):  # strings (or nested arrays): walk past them
                    if item == _GGUF_STRING:
                        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
                    else:
                        _, pos = value(item, pos, key)
                return None, pos

            for _ in range(n_kv):
                key, pos = string(pos)
                (kind,) = struct.unpack_from("<I", buf, pos)
                meta[key], pos = value(kind, pos + 4, key)
            tensors = {}
            for _ in range(n_tensors):
                name, pos = string(pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                tensors[name] = math.prod(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
                pos += 4 + 8 * n_dims + 4 + 8  # dims, type, offset
    except ConfigError:
        raise
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"cannot read GGUF file {path}: {exc}") from exc
    return meta, lengths, tensors


def gguf_spec(path: Path) -> dict[str, Any]:
    """ModelSpec keywords from a GGUF file's metadata (``{arch}.block_count``...) and tensor sizes."""
    meta, lengths, tensors = read_gguf_header(path)
    arch = meta.get("general.architecture")

    def key(name: str, default: Any = None) -> Any:
        got = meta.get(f"{arch}.{name}", default)
        if got is None:
            raise ConfigError(f"{path}: GGUF metadata has no {arch}.{name}")
        if not isinstance(got, int | float):
            raise ConfigError(f"{path}: {arch}.{name} is not a number (per-layer values are not supported)")
        return int(got)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    vocab = lengths.get("tokenizer.ggml.tokens") or key("vocab_size")
    num_layers, max_context = key("block_count"), key("context_length", 0) or None
    return dict(
        name=path.stem,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length", hidden // heads),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        vocab_size=vocab,
        num_params=sum(tensors.values()),
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm=arch in ("qwen3", "gemma3"),
        sandwich_norm=arch == "gemma3",
        **(_gguf_gemma3_layers(meta, path, num_layers, max_context) if arch == "gemma3" else {}),
        max_context=max_context,
        source="gguf",
    )


def _gguf_gemma3_layers(meta: dict[str, Any], path: Path, num_layers: int, max_context: int | None) -> dict:
    """A Gemma 3 GGUF's ``layer_types`` and ``sliding_window``, read as the engine's GGUF loader reads
    them (``kvtier.models.gguf_arch.gemma3_config``); a window past the context is clamped to it."""
    from kvtier.models.gguf_arch import gemma3_layer_types  # torch-free

    window = meta.get("gemma3.attention.sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{path}: GGUF metadata has no gemma3.attention.sliding_window (a positive size)")
    layer_types = gemma3_layer_types(meta.get("gemma3.attention.sliding_window_pattern"), num_layers)
    return dict(layer_types=tuple(layer_types), sliding_window=min(window, max_context or window))
