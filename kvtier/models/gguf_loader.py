"""One-time conversion of a GGUF file (llama, qwen2, qwen3, gemma3) into an HF-format directory.

The GGUF is read with ``gguf.GGUFReader``; every tensor is dequantized to fp32 with
``gguf.quants.dequantize``, renamed to its HF name and given HF's values (llama's ``attn_q`` / ``attn_k``
rows un-permuted, Gemma's norms less the 1 llama.cpp adds: :mod:`kvtier.models.gguf_arch` has the
per-architecture facts). The result is written as ``config.json`` (what transformers would save for the
model) + ``model.safetensors`` (fp32, streamed tensor by tensor) + ``tokenizer.json`` +
``tokenizer_config.json``, which the HF loader then memory-maps on every later start.

The tokenizer is rebuilt from GGUF metadata with the ``tokenizers`` library (no transformers at run time),
the way ``transformers`` builds it from a GGUF (byte-level BPE or SentencePiece BPE, control tokens as
special added tokens).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config import ConfigError
from kvtier.models.gguf_arch import (
    check_architecture,
    gemma3_config,
    head_counts,
    hf_tensor_name,
    norm_offset,
    permutes_qk,
    qwen3_config,
    turn_end_ids,
)
from kvtier.models.gguf_tokenizer import build_tokenizer, save_tokenizer_json
from kvtier.models.hf_loader import expected_shapes, optional_shapes, parse_config
from kvtier.models.registry import GGUF_ARCHITECTURES

__all__ = ["SUPPORTED_GGUF_ARCHITECTURES", "convert_gguf", "hf_tensor_name", "open_reader", "unpermute_rows"]

SUPPORTED_GGUF_ARCHITECTURES = GGUF_ARCHITECTURES  # general.architecture -> HF class (registry.py)
_NATIVE_DTYPE_BY_FILE_TYPE = {
    0: "float32",
    1: "float16",
    32: "bfloat16",
}  # general.file_type; rest: quantized

_IGNORED_TENSORS = {"rope_freqs.weight"}  # llama3 frequency factors: read into rope_scaling instead


def open_reader(path: Path) -> Any:
    """A ``gguf.GGUFReader`` for ``path``; ConfigError when the file is not a readable GGUF."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - gguf is a hard dependency
        raise ConfigError("reading GGUF files needs the gguf package: pip install gguf") from exc
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # GGUFReader raises ValueError / struct.error / OSError on bad files
        raise ConfigError(f"cannot read GGUF file {path}: {exc}") from exc


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key as a Python value (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an exotic field we do not need must not stop the conversion
            continue
    return meta


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: rows [head, dim/2, 2] -> [head, 2, dim/2] (weights and biases)."""
    half = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weight.shape))


def _llama3_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores in ``rope_freqs.weight`` for llama3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, medium))


def fit_llama3_scaling(freqs: np.ndarray, head_dim: int, theta: float, ctx: int) -> dict[str, Any] | None:
    """Recover HF's llama3 ``rope_scaling`` from a ``rope_freqs`` tensor (None when it is all ones)."""
    freqs = freqs.astype(np.float64).reshape(-1)
    factor = float(freqs.max())
    if np.allclose(freqs, 1.0):
        return None
    origs = sorted({ctx, *(2**k for k in range(6, 19))})
    for orig in origs:
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 2.0, 8.0, 1.5):
                if high <= low:
                    continue
                if np.allclose(_llama3_factors(head_dim, theta, factor, low, high, orig), freqs, rtol=1e-4):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": orig,
                    }
    raise ConfigError("cannot map this GGUF's rope_freqs tensor to a llama3 rope scaling")


def _rope_scaling(meta: dict[str, Any], arch: str, reader: Any, head_dim: int, theta: float, ctx: int) -> Any:
    """rope_scaling from metadata (``rope.scaling.*``, ``rope.scale_linear``) or ``rope_freqs.weight``."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)} if factor and float(factor) != 1.0 else None
    if kind not in (None, "none"):
        raise ConfigError(f"unsupported rope scaling type {kind!r} in GGUF (supported: llama3, linear)")
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            freqs = dequantize_tensor(tensor)
            return fit_llama3_scaling(freqs, head_dim, theta, ctx)
    return None


def _native_dtype(meta: dict[str, Any]) -> str:
    """``float16`` / ``bfloat16`` for unquantized half-precision files, else ``float32``."""
    return _NATIVE_DTYPE_BY_FILE_TYPE.get(int(meta.get("general.file_type", 0)), "float32")


def hf_config(meta: dict[str, Any], reader: Any) -> dict[str, Any]:
    """An HF ``config.json`` dict for the GGUF (architecture, sizes, rope, special ids), as transformers
    would save it for the same model (llama / qwen2 in the transformers 4 form kvtier always wrote)."""
    arch = check_architecture(meta)
    common = _common_config(meta, reader, arch)
    if arch == "qwen3":
        return qwen3_config(meta, common)
    if arch == "gemma3":
        return gemma3_config(meta, common)
    names = {t.name for t in reader.tensors}
    theta, scaling = common["rope_parameters"]["rope_theta"], common.pop("rope_scaling")
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        **{k: common[k] for k in _SHAPE_KEYS},
        "rms_norm_eps": common["rms_norm_eps"],
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": common["max_position_embeddings"],
        "tie_word_embeddings": common["tie_word_embeddings"],
        "attention_bias": common["attention_bias"],
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "hidden_act": "silu",
        "bos_token_id": common["bos_token_id"],
        "eos_token_id": common["eos_token_id"],
        "dtype": common["dtype"],
    }


_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
_SHAPE_KEYS += ("num_attention_heads", "num_key_value_heads", "head_dim")


def _common_config(meta: dict[str, Any], reader: Any, arch: str) -> dict[str, Any]:
    """The config keys every architecture has (sizes checked for consistency, rope, special ids)."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata is missing {arch}.{name}")
        return value

    hidden, inter, layers = (int(key(k)) for k in ("embedding_length", "feed_forward_length", "block_count"))
    heads, kv_heads, head_dim = head_counts(meta, arch)
    theta, ctx = float(key("rope.freq_base", 10000.0)), int(key("context_length", 2048))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConfigError("GGUF file has no token_embd.weight tensor")
    scaling = _rope_scaling(meta, arch, reader, head_dim, theta, ctx)
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos += turn_end_ids(arch, tokens)  # Gemma's <end_of_turn>, Qwen3's <|im_end|> (none for llama)
    names = {t.name for t in reader.tensors}
    common = {
        "vocab_size": int(embd.shape[-1]),  # ne = [hidden, vocab]: the embedding is the truth
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": theta},
        "rope_scaling": scaling,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": _native_dtype(meta),
    }
    if arch in ("qwen3", "gemma3"):
        del common["rope_scaling"]
    return common


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One GGUF tensor as fp32, in numpy (row-major, HF) shape: GGUF's ``ne`` reversed."""
    from gguf.quants import dequantize

    try:
        data = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ConfigError(f"unsupported GGUF tensor type {tensor.tensor_type.name} ({tensor.name})") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.ascontiguousarray(data, dtype=np.float32).reshape(shape)


def plan_tensors(reader: Any, config: dict[str, Any], arch: str) -> list[tuple[Any, str, tuple[int, ...]]]:
    """``(gguf tensor, hf name, hf shape)`` for every weight, checked against the config's expected shapes."""
    model_config = parse_config(config)
    required, optional = expected_shapes(model_config), optional_shapes(model_config)
    plan = []
    for tensor in reader.tensors:
        if tensor.name in _IGNORED_TENSORS:
            continue
        name = hf_tensor_name(tensor.name, arch)
        if name is None or (name not in required and name not in optional):
            raise ConfigError(f"unsupported tensor {tensor.name!r} in GGUF")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        want = required.get(name) or optional[name]
        if shape != want:
            raise ConfigError(f"GGUF tensor {tensor.name} has shape {shape}, expected {want}")
        plan.append((tensor, name, shape))
    planned = {name for _, name, _ in plan}
    if missing := [n for n in required if n not in planned]:
        raise ConfigError(f"GGUF file is missing tensors for {', '.join(missing[:3])}")
    return plan


def hf_tensors(
    reader: Any, config: dict[str, Any], plan: list[tuple[Any, str, tuple[int, ...]]], arch: str
) -> Iterator[np.ndarray]:
    """The planned tensors one at a time, in HF's values: dequantized (fp32), llama's q/k rows un-permuted,
    Gemma's norms less the 1 llama.cpp added (see :mod:`kvtier.models.gguf_arch`)."""
    permute, offset = permutes_qk(arch), norm_offset(arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor, name, _ in plan:
        data = dequantize_tensor(tensor)
        if permute and ".self_attn.q_proj." in name:
            data = unpermute_rows(data, heads)
        elif permute and ".self_attn.k_proj." in name:
            data = unpermute_rows(data, kv_heads)
        elif offset and tensor.name.endswith("norm.weight"):
            data = data - np.float32(offset)
        yield data


def write_safetensors(
    path: Path,
    entries: list[tuple[str, tuple[int, ...]]],
    tensors: Iterator[np.ndarray],
    tick: Callable[[], None],
) -> None:
    """Stream fp32 tensors into a safetensors file: header from the planned shapes, then data in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, shape), data in zip(entries, tensors, strict=True):
            assert data.shape == shape and data.dtype == np.float32, name
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            tick()


def convert_gguf(
    src: Path, dst: Path, *, progress: bool = False, extra_config: dict[str, Any] | None = None
) -> None:
    """Write the HF-format conversion of GGUF ``src`` into the (existing, empty) directory ``dst``."""
    if progress:
        print(f"kvtier: converting {src} (one time) ...", file=sys.stderr, flush=True)
    reader = open_reader(src)
    meta = read_metadata(reader)
    config = hf_config(meta, reader)
    tokenizer, tokenizer_config = build_tokenizer(meta)
    if "max_position_embeddings" in config:
        tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    arch = meta["general.architecture"]
    plan = plan_tensors(reader, config, arch)
    config.update(extra_config or {})
    bar = _progress_bar(len(plan), enabled=progress)
    try:
        entries = [(name, shape) for _, name, shape in plan]
        tensors = hf_tensors(reader, config, plan, arch)
        write_safetensors(dst / "model.safetensors", entries, tensors, bar.update)
    finally:
        bar.close()
    save_tokenizer_json(tokenizer, dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class _NoBar:
    """Stand-in for a tqdm bar when progress is off."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, *, enabled: bool) -> Any:
    """A tqdm bar on stderr (only imported when asked for)."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="kvtier: dequantizing", unit="tensor", file=sys.stderr)
